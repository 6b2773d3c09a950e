"""The multi-turn agent loop: environment turns -> engine stream -> StreamRecord(s).

One episode is one engine stream. Each turn: append the assistant header, sample the
assistant message (stop at end-of-turn), step the environment with its text, append the
answer as environment tokens (no loss). After each completed turn the compaction
strategy may evict whole turns: in place (``kv_streams``: the engine frees their KV,
nothing is recomputed) or by re-prefilling the kept context into a fresh stream
(``reprefill``: the baseline, whose cost the accounting records). Many episodes run
concurrently (asyncio) against one engine, which batches their steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from kvstreams_sglang.engine import SamplingParams
from trainer_masks import StreamLedger

from .chat import ChatRenderer
from .client import EngineClient
from .compaction import Compaction, CompactionConfig, EpisodeView, Exchange, Span, make_strategy
from .protocol import Environment, Task, answer_budget, turn_cap_hook


class EpisodeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(30, ge=1, description="turn cap per episode")
    max_stream_tokens: int = Field(32768, ge=16, description="stream-length cap (all tokens ever in the stream, "
                                   "evicted ones included); not the KV pool's size (inference.kv_slots)")
    max_new_tokens: int = Field(128, ge=1, description="assistant tokens per turn")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    env_in_thread: bool = Field(True, description="step the environment in a worker thread (off for cheap, "
                                                  "deterministic environments: a single-threaded schedule)")


@dataclass
class EpisodeStats:
    turns: int = 0
    tokens_generated: int = 0
    env_tokens: int = 0
    tokens_reprefilled: int = 0
    peak_live_tokens: int = 0
    live_samples: list[int] = field(default_factory=list)
    compactions: int = 0
    summary_tokens: int = 0
    pick_fallbacks: int = 0
    # wall seconds this episode spent waiting on the engine, on the environment (its tools), and of that on
    # grading (an environment reports it as a step's ``info["grade_s"]``, e.g. SWE's hidden tests at submit)
    generate_s: float = 0.0
    env_s: float = 0.0
    grade_s: float = 0.0

    @property
    def mean_live_tokens(self) -> float:
        return sum(self.live_samples) / max(1, len(self.live_samples))

    def as_dict(self) -> dict:
        d = {k: v for k, v in vars(self).items() if k != "live_samples"}
        return {**d, "mean_live_tokens": self.mean_live_tokens}


@dataclass
class Episode:
    task: Task
    reward: float
    won: bool
    records: list  # StreamRecord segments: one in kv_streams mode, one per context window in reprefill mode
    stats: EpisodeStats
    finish_reason: str
    turn_spans: list[tuple[int, Span]] = field(default_factory=list)  # (segment, [start, end)) of completed turns


def turn_seed(seed: int, generation: int) -> int:
    """The sampling seed of an episode's ``generation``-th generation. The engine seeds a fresh
    generator per request: with the episode's seed on every turn, every turn would draw the
    same noise, and once contexts look alike (a sliding window after a failed move) the
    "sampled" command repeats almost surely (81% repeats seen), so rollouts would not be draws
    from the policy whose logprobs they record. Still a function of the episode's seed."""
    digest = hashlib.blake2b(f"{seed}:{generation}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31)


class StreamConversation:
    """The episode as the loop and the strategies see it (implements ``compaction.Conversation``):
    the turn structure (first message, completed turns, their texts) in positions of the current
    stream, over the stream's ``StreamLedger`` (tokens, what is computed, what is evicted), which
    the client owns. In re-prefill mode each context window is a new stream."""

    def __init__(self, client: EngineClient, renderer: ChatRenderer, sampling: SamplingParams, stats: EpisodeStats):
        self.client, self.renderer, self.sampling, self.stats = client, renderer, sampling, stats
        self.generations = 0  # generations so far: each one draws its own sampling noise (``turn_seed``)
        self.sid: int | None = None
        self.ledger: StreamLedger | None = None
        self.first: Span = (0, 0)
        self.turns: list[Span] = []
        self.turn_texts: list[str] = []
        self.segments: list = []
        self.turn_log: list[tuple[int, Span]] = []  # (segment, span) of every completed turn

    @property
    def end(self) -> int:
        return self.ledger.end

    @property
    def live_tokens(self) -> int:
        """The live context: kept computed tokens and the pending ones."""
        return self.ledger.num_live + self.ledger.num_pending

    async def _open(self, stream: list[int] | StreamLedger) -> None:
        self.sid = await self.client.open(stream)
        self.ledger = self.client.ledger(self.sid)

    async def open(self, first_message: list[int]) -> None:
        await self._open(first_message)
        self.first = (0, len(first_message))

    async def append(self, token_ids: list[int], source: str = "env") -> Span:
        start = self.end
        await self.client.append(self.sid, token_ids, source)
        self.stats.env_tokens += len(token_ids)
        return start, self.end

    async def assistant(self, max_new_tokens: int) -> tuple[list[int], bool]:
        """Header, then a sampled message; returns (tokens, closed by end-of-turn)."""
        await self.append(self.renderer.assistant_header())
        seed = None if self.sampling.seed is None else turn_seed(self.sampling.seed, self.generations)
        self.generations += 1
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=self.sampling.temperature,
                                top_p=self.sampling.top_p, top_k=self.sampling.top_k,
                                stop_token_ids=tuple(self.renderer.eos_ids), seed=seed)
        ready = getattr(self.client, "ready", None)  # a client that holds calls (the harness's, paused for an
        if ready is not None:  # evaluation): its hold is not time spent on the engine
            await ready()
        t0 = time.perf_counter()
        gen = await self.client.generate(self.sid, params)
        self.stats.generate_s += time.perf_counter() - t0
        self.stats.tokens_generated += len(gen.token_ids)
        live = self.ledger.num_live
        self.stats.live_samples.append(live)
        self.stats.peak_live_tokens = max(self.stats.peak_live_tokens, live)
        return gen.token_ids, gen.finish_reason == "stop"

    async def ask(self, instruction: str, max_new_tokens: int) -> Exchange:
        instr = await self.append(self.renderer.user_message(instruction))
        start = self.end
        tokens, closed = await self.assistant(max_new_tokens)
        await self.append(self.renderer.after_assistant(closed=closed))
        return Exchange(instruction=instr, answer=(start, self.end), text=self.renderer.action_text(tokens))

    def live_ranges(self, start: int, end: int) -> list[Span]:
        """Maximal runs of live positions in ``[start, end)``."""
        return self.ledger.live_ranges(start, end)

    async def flush(self) -> None:
        """Compute the pending tokens' KV now, so that they can be evicted."""
        await self.client.prefill(self.sid)

    async def restate(self, text: str) -> Span:
        return await self.append(self.renderer.user_message(text))

    async def evict(self, spans: list[Span], execution: str) -> None:
        spans = sorted(spans)
        if not spans:
            return
        dead = {p for a, b in spans for p in range(a, b)}
        kept_turns = [(t, x) for t, x in zip(self.turns, self.turn_texts, strict=True) if t[0] not in dead]
        if execution == "kv_streams":
            await self.client.evict(self.sid, spans)
            self.turns, self.turn_texts = [t for t, _ in kept_turns], [x for _, x in kept_turns]
            return
        # Re-prefill: close this context window, re-open a fresh stream on the kept tokens.
        old = self.ledger
        kept = [p for p in range(old.end) if p not in dead]
        self.stats.tokens_reprefilled += sum(1 for p in kept if p < old.num_computed)
        new_index = {p: i for i, p in enumerate(kept)}
        self.segments.append(await self.client.close(self.sid))
        await self._open(old.reopen(kept))
        self.first = (0, new_index[self.first[1] - 1] + 1)
        self.turns = [(new_index[a], new_index[b - 1] + 1) for (a, b), _ in kept_turns]
        self.turn_texts = [x for _, x in kept_turns]

    async def finish(self, **meta) -> list:
        self.segments.append(await self.client.close(self.sid, **meta))
        return self.segments


async def run_episode(client: EngineClient, env: Environment, task: Task, renderer: ChatRenderer,
                      compaction: CompactionConfig, config: EpisodeConfig, *, seed: int | None = None) -> Episode:
    stats = EpisodeStats()
    sampling = SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k, seed=seed)
    conv = StreamConversation(client, renderer, sampling, stats)
    strategy = make_strategy(compaction)
    # an environment in a worker process (rollout.env_processes) is waited for off the loop, whatever the config
    threaded = config.env_in_thread or getattr(env, "in_another_process", False)

    async def call(fn, *args):
        t0 = time.perf_counter()
        try:
            return await asyncio.to_thread(fn, *args) if threaded else fn(*args)
        finally:
            stats.env_s += time.perf_counter() - t0

    try:  # the environment is closed whatever happens: an SWE sandbox or a worker's game is not left behind
        observation = await call(env.reset, task)
        await conv.open(renderer.first_message(observation))
        reward, won, finish = 0.0, False, "max_turns"
        for turn in range(config.max_turns):
            start = conv.end
            bound = answer_budget(env)
            tokens, closed = await conv.assistant(config.max_new_tokens if bound is None
                                                  else min(bound, config.max_new_tokens))
            action = renderer.action_text(tokens)
            result = await call(env.step, action)
            stats.grade_s += float(result.info.get("grade_s", 0.0))
            reward += result.reward
            stats.turns = turn + 1
            if result.done:
                won, finish = bool(result.info.get("won", result.reward > 0)), "done"
                break
            if conv.end >= config.max_stream_tokens:
                finish = "max_stream_tokens"
                break
            if turn == config.max_turns - 1:
                break  # the last turn stays unfinished: its answer would never be read
            await conv.append(renderer.after_assistant(closed=closed) + renderer.user_message(result.observation))
            conv.turns.append((start, conv.end))
            conv.turn_log.append((len(conv.segments), (start, conv.end)))
            conv.turn_texts.append(action)
            view = EpisodeView(first_message=conv.first, turns=list(conv.turns),
                               live_tokens=conv.live_tokens, turns_completed=turn + 1,
                               turn_texts=list(conv.turn_texts), last_observation=result.observation)
            if strategy.triggered(view):
                c: Compaction = await strategy.compact(view, conv)
                await conv.evict(c.evict, compaction.execution)
                stats.compactions += 1
                stats.summary_tokens += c.summary_tokens
                stats.pick_fallbacks += int(c.pick_fallback)
        cap = turn_cap_hook(env)
        if finish != "done" and cap is not None:
            result = await call(cap)
            if result is not None:
                stats.grade_s += float(result.info.get("grade_s", 0.0))
                reward += result.reward
                won = bool(result.info.get("won", result.reward > 0))
    except BaseException:  # closed too, but its own error must not hide the episode's (a cancelled run's workers
        with contextlib.suppress(Exception):  # are gone by then: closing them fails)
            await call(env.close)
        raise
    await call(env.close)
    meta = dict(task_id=task.task_id, reward=reward, won=won, strategy=compaction.strategy,
                execution=compaction.execution, stats=stats.as_dict())
    records = await conv.finish(**meta)
    return Episode(task=task, reward=reward, won=won, records=records, stats=stats, finish_reason=finish,
                   turn_spans=conv.turn_log)


async def run_episodes(client: EngineClient, make_env, tasks: list[Task], renderer: ChatRenderer,
                       compaction: CompactionConfig, config: EpisodeConfig, *, concurrency: int = 64,
                       seed: int = 0, on_episode: Callable[[Episode], None] | None = None) -> list[Episode]:
    """Run ``tasks`` concurrently (at most ``concurrency`` at a time) against one engine;
    ``on_episode`` is called as each one ends (progress bars)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, task: Task) -> Episode:
        async with sem:
            ep = await run_episode(client, make_env(), task, renderer, compaction, config, seed=seed + i)
        if on_episode is not None:
            on_episode(ep)
        return ep

    return list(await asyncio.gather(*(one(i, t) for i, t in enumerate(tasks))))

"""Recorded TextWorld episodes replayed through the real agent loop, for the rollout benchmarks.

The benchmarks do not re-implement the agent loop: every episode runs ``envs.rollout.agent_loop.run_episode``
(the chat renderer, the real compaction strategies, the ``kv_streams`` / ``reprefill`` executions) against an
engine client (the built-in engine, our SGLang server, a stock one). What is replayed is the *shape* of
recorded episodes:

- ``EpisodeSpec`` / ``load_episode_pool`` / ``sample_episodes``: token counts of real TextWorld episodes
  (``bench/data/textworld_turns.json``, made by ``bench.textworld_lengths``; units in its header: ``first``
  = first message + assistant header, per turn ``[action incl. end-of-turn, obs incl. separator, user message
  and the next assistant header]``), drawn with a seed so that every configuration replays the same episodes.
- ``ReplayEnvironment``: an ``Environment`` that answers each action with an observation of its recorded
  token length and bounds each assistant message to its recorded length (``max_new_tokens``, read by the loop
  through ``envs.rollout.protocol.answer_budget``). Under the renderer's chat template (``Template``: the tokens
  the template adds to each piece) the stream then has the recorded counts token for token.
- ``LedgerClient`` / ``episode_peaks``: a model-free pass of the same loop that measures the most tokens an
  episode's stream holds at once (live + pending) under a strategy: the KV an engine must reserve for it.
- ``Gate``: admission (the episodes' reservations within a KV budget, at most ``max_batch`` at once;
  continuous refill or synchronous waves), and ``run_replay``: episodes admitted through a gate, each its own
  ``run_episode``, until they are done or a stop signal cuts them at their next turn.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from envs.rollout.agent_loop import Episode, EpisodeConfig, run_episode
from envs.rollout.chat import ChatRenderer
from envs.rollout.compaction import CompactionConfig
from envs.rollout.protocol import StepResult, Task
from kvstreams_sglang.engine import Generation
from trainer_masks import StreamLedger

DATA = Path(__file__).parent / "data" / "textworld_turns.json"
SYSTEM_PROMPT = "You are replaying a recorded text-game episode."
ALPHABET = "abcdefghijklmnopqrstuvwxyz     "  # one token per character with the byte tokenizer


# ---- episodes ----


@dataclass(frozen=True)
class EpisodeSpec:
    """Token counts of one episode: ``first`` (first message + assistant header), then per turn
    ``(action, obs)``: tokens of the assistant message incl. its end-of-turn token, then tokens appended
    after it (separator, user message, next assistant header; 0 after the last turn)."""

    first: int
    turns: tuple[tuple[int, int], ...]
    source: str = ""

    @property
    def generated(self) -> int:
        """Tokens the model samples in a replay: every message but the last ends in an end-of-turn token the
        loop appends (the model is bounded to its other tokens); the last message is sampled whole."""
        return sum(a - 1 for a, _ in self.turns) + 1

    @property
    def total(self) -> int:
        return self.first + sum(a + o for a, o in self.turns)


@dataclass(frozen=True)
class Template:
    """Tokens a chat template adds around each piece of an episode: the first message (system prompt,
    tags, first assistant header), an assistant message (its end-of-turn token) and an observation
    (separator, user-message tags, next assistant header)."""

    first: int
    action: int
    obs: int

    @classmethod
    def of(cls, renderer: ChatRenderer) -> Template:
        if len(renderer.encode("ab cd")) != 5:
            raise ValueError("replayed texts need a tokenizer with one token per character (the byte tokenizer of "
                             "kvstreams_sglang.checkpoints)")
        header = len(renderer.assistant_header())
        after = len(renderer.after_assistant(closed=False))  # end-of-turn + separator
        return cls(first=len(renderer.first_message("")) + header, action=1,
                   obs=after - 1 + len(renderer.user_message("")) + header)


def load_episode_pool(path: str | Path = DATA, policies: tuple[str, ...] | None = None) -> list[EpisodeSpec]:
    data = json.loads(Path(path).read_text())
    return [EpisodeSpec(e["first"], tuple(tuple(t) for t in e["turns"]), f"{e['preset']}/{e['policy']}")
            for e in data["episodes"] if policies is None or e["policy"] in policies]


def sample_episodes(pool: list[EpisodeSpec], n: int, seed: int, *, length_scale: float = 1.0,
                    max_turns: int | None = None, template: Template | None = None) -> list[EpisodeSpec]:
    """``n`` episodes drawn with replacement (seeded), turns cut at ``max_turns``. ``length_scale``
    scales the text of every piece (e.g. ~0.3: what a BPE tokenizer makes of the recorded byte counts), not
    the ``template``'s tokens around it; every piece keeps at least one text token."""
    if length_scale != 1.0 and template is None:
        raise ValueError("scaling lengths needs the template whose tokens it leaves alone")
    rng = random.Random(seed)

    def scale(x: int, keep: int) -> int:
        return x if length_scale == 1.0 else keep + max(1, round((x - keep) * length_scale))

    out = []
    for _ in range(n):
        e = pool[rng.randrange(len(pool))]
        turns = list(e.turns[:max_turns] if max_turns else e.turns)
        turns[-1] = (turns[-1][0], 0)  # the episode ends after its last action
        t = template or Template(0, 0, 0)
        out.append(EpisodeSpec(scale(e.first, t.first),
                               tuple((scale(a, t.action), scale(o, t.obs) if o else 0) for a, o in turns), e.source))
    return out


def long_tailed_episodes(pool: list[EpisodeSpec], n: int, seed: int, *, alpha: float = 1.1, min_turns: int = 4,
                         max_turns: int = 80, length_scale: float = 1.0,
                         template: Template | None = None) -> list[EpisodeSpec]:
    """``n`` longer games with a long tail of lengths: each has a recorded first message and a Pareto(``alpha``)
    number of turns (at least ``min_turns``, at most ``max_turns``), each turn a recorded ``(action, obs)`` drawn
    from the whole pool (the synchronous-waves penalty grows with ``E[max of a wave] / E[length]``)."""
    rng = random.Random(seed)
    turns = [t for e in sample_episodes(pool, len(pool), seed, length_scale=length_scale, template=template)
             for t in e.turns if t[1]]
    firsts = sample_episodes(pool, n, seed + 1, length_scale=length_scale, template=template)
    out = []
    for e in firsts:
        k = min(max_turns, int(min_turns / (1.0 - rng.random()) ** (1.0 / alpha)))
        chosen = [turns[rng.randrange(len(turns))] for _ in range(k)]
        chosen[-1] = (chosen[-1][0], 0)
        out.append(EpisodeSpec(e.first, tuple(chosen), f"long-tailed/{k} turns"))
    return out


def length_stats(xs) -> dict:
    xs = sorted(xs)
    return dict(n=len(xs), mean=statistics.fmean(xs), min=xs[0], p50=xs[len(xs) // 2], max=xs[-1])


def expected_max_over_mean(lengths: list[int], batch: int) -> float:
    """``E[max of batch i.i.d. draws] / E[L]`` for ``L`` drawn uniformly from ``lengths``
    (exact: ``P(max <= x_(i)) = (i/n)^batch`` over the sorted sample)."""
    xs = sorted(lengths)
    n = len(xs)
    e_max = sum(x * (((i + 1) / n) ** batch - (i / n) ** batch) for i, x in enumerate(xs))
    return e_max / statistics.fmean(xs)


# ---- the environment ----


class ReplayEnvironment:
    """Plays one ``EpisodeSpec``: observations are random lowercase text of the recorded token length (minus
    the ``template``'s tokens), each assistant message is bounded to its recorded length, and the episode ends
    after its last recorded turn (reward 1). ``stop``: once it returns True the episode ends at its next step
    (``truncated``), so a timed run ends within one turn."""

    system_prompt = SYSTEM_PROMPT

    def __init__(self, spec: EpisodeSpec, template: Template, *, seed: int = 0,
                 stop: Callable[[], bool] | None = None):
        for length, keep, what in [(spec.first, template.first, "first message")] + [
                (a, template.action + 1, "action") for a, _ in spec.turns] + [
                (o, template.obs, "observation") for _, o in spec.turns if o]:
            if length < keep:
                raise ValueError(f"{spec.source or 'episode'}: a {what} of {length} tokens is shorter than the "
                                 f"{keep} tokens the template puts around it")
        self.spec, self.template, self.stop = spec, template, stop
        self.rng = random.Random(seed)
        self.turn = 0
        self.truncated = False

    def _text(self, n: int) -> str:
        return "".join(self.rng.choices(ALPHABET, k=n))

    def reset(self, task: Task) -> str:
        self.turn, self.truncated = 0, False
        return self._text(self.spec.first - self.template.first)

    def max_new_tokens(self) -> int:
        """The recorded message length, less the end-of-turn token the loop appends after it (nothing is
        appended after the last message: it is sampled whole)."""
        action, obs = self.spec.turns[self.turn]
        last = obs == 0 or self.turn == len(self.spec.turns) - 1
        return action if last else action - self.template.action

    def step(self, action: str) -> StepResult:
        _, obs = self.spec.turns[self.turn]
        self.turn += 1
        if obs == 0 or self.turn >= len(self.spec.turns):
            return StepResult("", 1.0, True, {"won": True})
        if self.stop is not None and self.stop():
            self.truncated = True
            return StepResult("", 0.0, True, {"won": False, "truncated": True})
        return StepResult(self._text(obs - self.template.obs), 0.0, False, {})

    def expert_action(self) -> str | None:
        return None

    def close(self) -> None:
        pass


def episode_config(**overrides) -> EpisodeConfig:
    """The loop's settings for a replay: the environment bounds every turn, nothing else does."""
    return EpisodeConfig(**dict(dict(max_turns=10_000, max_stream_tokens=1 << 30, max_new_tokens=1 << 20,
                                     temperature=1.0, env_in_thread=False), **overrides))


# ---- sizing: the same loop without a model ----


class LedgerClient:
    """A model-free ``EngineClient``: a generation writes ``max_new_tokens`` placeholder tokens (a model that
    never stops early), with the engine's stream semantics on a bare ``StreamLedger`` (pending tokens are
    computed by the next generation, the last sampled one stays pending). ``peak``: the most tokens one of its
    streams held at once, live + pending, seen after every call: what an engine must reserve for them."""

    policy_version = 0

    def __init__(self, token_id: int = 0):
        self.token_id = token_id
        self.streams: dict[int, StreamLedger] = {}
        self.peak = 0

    def _see(self, ledger: StreamLedger) -> None:
        self.peak = max(self.peak, ledger.num_live + ledger.num_pending)

    async def open(self, stream):
        sid = len(self.streams)
        self.streams[sid] = stream if isinstance(stream, StreamLedger) else StreamLedger(stream)
        self._see(self.streams[sid])
        return sid

    def ledger(self, sid):
        return self.streams[sid]

    async def append(self, sid, token_ids, source="env"):
        self.streams[sid].append(token_ids, source)
        self._see(self.streams[sid])

    async def generate(self, sid, params) -> Generation:
        ledger = self.streams[sid]
        for _ in range(params.max_new_tokens):
            ledger.commit(ledger.num_pending)
            ledger.add_sampled(self.token_id, 0.0, 0)
        self._see(ledger)
        return Generation([self.token_id] * params.max_new_tokens, [0.0] * params.max_new_tokens, "length")

    async def evict(self, sid, spans):
        return len(self.streams[sid].evict(spans).dropped)

    async def prefill(self, sid):
        self.streams[sid].commit(self.streams[sid].num_pending)

    async def reprefill_streams(self, sids=None):
        return 0

    async def close(self, sid, **meta):
        return self.streams.pop(sid).to_record(**meta)


async def episode_peak(spec: EpisodeSpec, renderer: ChatRenderer, compaction: CompactionConfig,
                       config: EpisodeConfig) -> int:
    client = LedgerClient()
    await run_episode(client, ReplayEnvironment(spec, Template.of(renderer)), Task("size", "bench"), renderer,
                      compaction, config)
    return client.peak


def episode_peaks(specs: list[EpisodeSpec], renderer: ChatRenderer, compaction: CompactionConfig,
                  config: EpisodeConfig | None = None) -> list[int]:
    """Each episode's most live + pending tokens under ``compaction``, by a model-free run of the real loop."""
    config = config or episode_config()

    async def all_():
        return [await episode_peak(s, renderer, compaction, config) for s in specs]

    return asyncio.run(all_())


_SIZER: ChatRenderer | None = None


def _sizer_init(model_path: str) -> None:
    global _SIZER
    from transformers import AutoTokenizer

    _SIZER = ChatRenderer(AutoTokenizer.from_pretrained(model_path), SYSTEM_PROMPT)


def _sizer_peaks(specs: list[EpisodeSpec], compaction: dict) -> list[int]:
    return episode_peaks(specs, _SIZER, CompactionConfig(**compaction))


def episode_peaks_in_processes(executor, specs: list[EpisodeSpec], compaction: CompactionConfig, *,
                               chunks: int = 16):
    """``episode_peaks`` spread over ``executor`` (a process pool made by ``sizing_pool``: the loop is pure
    Python, about 1 ms a turn); returns a ``concurrent.futures.Future`` of the list, in order."""
    from concurrent.futures import Future

    size = max(1, -(-len(specs) // chunks))
    parts = [executor.submit(_sizer_peaks, specs[i:i + size], compaction.model_dump())
             for i in range(0, len(specs), size)]
    out: Future = Future()

    def collect(_):
        if all(p.done() for p in parts) and not out.done():
            try:
                out.set_result([x for p in parts for x in p.result()])
            except BaseException as e:
                out.set_exception(e)

    for p in parts:
        p.add_done_callback(collect)
    return out


def sizing_pool(model_path: str, workers: int):
    """Processes that run ``episode_peaks`` with the renderer of ``model_path`` (spawned: no tokenizer state
    crosses a fork)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=_sizer_init,
                               initargs=(model_path,))


# ---- admission and the run ----


class Gate:
    """Admits episodes in order. Refill: as soon as the next one's reservation fits the KV ``capacity`` next to
    the running ones' and fewer than ``max_batch`` run. Waves: a wave admits up to ``max_batch`` episodes; the
    next wave opens only when every episode of the previous one has finished. ``close()`` stops admitting.
    ``waiting_for``: why the next episode waits (``kv``, ``batch``, ``wave``), None when nothing waits."""

    def __init__(self, capacity: int, max_batch: int, *, waves: bool = False):
        self.capacity, self.max_batch, self.waves = capacity, max_batch, waves
        self.cond = asyncio.Condition()
        self.active = self.reserved = self.peak_active = 0
        self.wave_open, self.wave_size, self.num_waves = True, 0, 0
        self.closed = False
        self.waiting_for: str | None = None

    def _blocker(self, tokens: int) -> str | None:
        if self.waves and not self.wave_open:
            return "wave"
        if self.active >= self.max_batch:
            return "batch"
        if self.reserved + tokens > self.capacity:
            return "kv"
        return None

    async def acquire(self, tokens: int) -> bool:
        """Wait until ``tokens`` of KV can be reserved; False if the gate closed first."""
        if tokens > self.capacity:
            raise ValueError(f"an episode needs {tokens} KV tokens, the pool holds {self.capacity}")
        async with self.cond:
            while not self.closed and (reason := self._blocker(tokens)) is not None:
                self.waiting_for = reason
                await self.cond.wait()
            self.waiting_for = None
            if self.closed:
                return False
            self.active += 1
            self.peak_active = max(self.peak_active, self.active)
            self.reserved += tokens
            if self.waves:
                self.num_waves += self.wave_size == 0
                self.wave_size += 1
                self.wave_open = self.wave_size < self.max_batch
            return True

    async def release(self, tokens: int) -> None:
        async with self.cond:
            self.active -= 1
            self.reserved -= tokens
            if self.waves and self.active == 0:
                self.wave_open, self.wave_size = True, 0
            self.cond.notify_all()

    async def close(self) -> None:
        async with self.cond:
            self.closed = True
            self.cond.notify_all()


@dataclass
class Finished:
    """One replayed episode: its index, the loop's ``Episode``, whether a stop cut it, what admission
    reserved for it, and when it ended (``time.perf_counter``)."""

    index: int
    episode: Episode
    truncated: bool
    reserved: int
    ended: float


@dataclass
class Replay:
    """How a ``run_replay`` run is set up: the renderer, its template, the strategy and the loop's settings."""

    renderer: ChatRenderer
    compaction: CompactionConfig
    config: EpisodeConfig = field(default_factory=episode_config)
    seed: int = 0

    @property
    def template(self) -> Template:
        return Template.of(self.renderer)

    async def reservation(self, spec: EpisodeSpec) -> int:
        return await episode_peak(spec, self.renderer, self.compaction, self.config)


async def run_replay(client, episodes: Iterable[tuple[int, EpisodeSpec]], replay: Replay, gate: Gate, *,
                     stop: Callable[[], bool] | None = None, reservations: dict[int, int] | None = None,
                     on_episode: Callable[[Finished], None] | None = None,
                     return_exceptions: bool = False) -> list[Finished | BaseException]:
    """Every episode of ``episodes`` (``(index, spec)``; the index seeds its texts and its sampling) runs
    ``run_episode`` on ``client`` once ``gate`` admits it with its reservation (``reservations[index]``, else
    measured by ``Replay.reservation``). Stops admitting when the gate closes (or ``stop()`` holds); episodes
    still running then end at their next turn. Returns the finished episodes in admission order (with
    ``return_exceptions``, an episode that raised leaves its exception in its place)."""
    template = replay.template
    tasks: list[asyncio.Task] = []

    async def one(i: int, spec: EpisodeSpec, need: int) -> Finished:
        env = ReplayEnvironment(spec, template, seed=replay.seed * 1_000_003 + i, stop=stop)
        try:
            ep = await run_episode(client, env, Task(f"replay-{i}", "bench"), replay.renderer, replay.compaction,
                                   replay.config, seed=replay.seed + i)
        finally:
            await gate.release(need)
        done = Finished(i, ep, env.truncated, need, time.perf_counter())
        if on_episode is not None:
            on_episode(done)
        return done

    for i, spec in episodes:
        if stop is not None and stop():
            break
        need = reservations[i] if reservations is not None else await replay.reservation(spec)
        if not await gate.acquire(need):
            break
        if stop is not None and stop():  # it came true while this one waited
            await gate.release(need)
            break
        tasks.append(asyncio.create_task(one(i, spec, need)))
    return list(await asyncio.gather(*tasks, return_exceptions=return_exceptions))

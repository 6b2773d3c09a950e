"""SFT warm-start: the environment's expert played through the real agent loop, then
cross-entropy on its commands, scored exactly as the RL trainer scores rollouts.

The expert's episodes go through ``envs.rollout.agent_loop.run_episode`` with the run's
compaction strategy, so their records are the ``StreamRecord``s the sampler would have
produced had the model written the expert's commands: same chat rendering, same
positions, same eviction events. The model therefore learns to act from a *compacted*
context. ``ExpertClient`` stands in for the engine: it keeps each stream's ``StreamLedger``
(computed/pending tokens, evictions) and runs no model.

Detours (``SFTConfig.detour``): with that probability a turn plays a harmless command
(``look``, ``inventory``) instead of the expert's; its tokens are kept out of the loss.
Episodes then run long enough for the strategy to evict turns, and the model sees how to
carry on after a command that did not advance the game -- what it meets in its own
rollouts.

The loss: ``-sum(logprob of loss tokens) / loss tokens`` per step and rendering, averaged over the renderings
(``expert_nll``), from ``trainer_masks.score_streams`` on the trainer's (FSDP-wrapped) model.

Each episode's game is played once and replayed for the other renderings (``envs.rollout.transcript``): the
records are those of playing every rendering live, at about a third of the game time (ALFWorld on 2 cores: 72
episodes under three renderings in 83 s against 228 s).
"""

from __future__ import annotations

import asyncio
import io
import itertools
import multiprocessing
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from envs.cpus import usable_cpus
from envs.rollout.agent_loop import EpisodeConfig, run_episode
from envs.rollout.chat import ChatRenderer
from envs.rollout.compaction import CompactionConfig
from envs.rollout.protocol import Environment, Task, TaskSet
from envs.rollout.transcript import RecordingEnv, TranscriptEnv, TranscriptMismatch, replayable
from kvstreams_sglang.engine import Generation, SamplingParams
from trainer_masks import StreamLedger, StreamRecord
from trainer_masks.scoring import score_streams

from .config import Config, TrainerConfig
from .evaluate import episode_config, evaluate, make_engine
from .metrics import MetricsLog
from .trainer import Trainer, micro_batches

# Strategies whose compaction asks the model a question (a summary, a pick): the expert has
# no answer for those, so their records cannot be built this way.
ASKS_THE_MODEL = ("summary", "markovian_pick")


class SFTConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    steps: int = Field(40, ge=0, description="optimizer steps (0: no warm-start)")
    lr: float = Field(3e-3, gt=0)
    episodes_per_step: int = Field(16, ge=1, description="expert episodes per optimizer step (from each rendering "
                                   "when SFT renders under several compactions)")
    episodes: int = Field(256, ge=1, description="expert episodes played (over the train games); steps cycle "
                                                 "through them")
    detour: float = Field(0.5, ge=0, lt=1, description="probability that a turn plays a detour, not the expert")
    detours: list[str] = Field(["look", "inventory"], min_length=1, description="harmless commands")
    micro_batch_records: int = Field(4, ge=1)
    micro_batch_tokens: int | None = Field(None, ge=1, description="also caps a forward's packed tokens: records "
                                           "are packed up to micro_batch_records and this many tokens")
    stop_train_win_rate: float | None = Field(
        None, gt=0, le=1, description="stop early once the greedy policy wins this share of check_games train games "
        "(checked every check_every steps): RL then starts from the same competence whatever step a seed's SFT "
        "reaches it (steps is the cap)")
    check_every: int = Field(10, ge=1)
    check_games: int = Field(32, ge=1)
    probe_episodes: int = Field(32, ge=1, description="expert episodes of the eval split whose command loss is "
                                                      "reported before and after")
    expert_workers: int = Field(1, ge=0, description="processes playing the expert episodes (0: one per CPU core); "
                                "the records are the same whatever the number")


class ExpertClient:
    """An ``EngineClient`` that writes ``env``'s expert commands instead of sampling a model.

    Mirrors the engine's stream semantics on a bare ``StreamLedger`` without running a model: a
    generation first computes every pending token, each "sampled" token is pending until the
    next one is produced, and the last one stays pending; evictions are recorded at the computed
    boundary. One client per episode (it reads its environment's expert)."""

    policy_version = 0

    def __init__(self, env: Environment, renderer: ChatRenderer, *, detour: float = 0.0,
                 detours: list[str] | tuple[str, ...] = ("look",), seed: int = 0):
        self.env, self.renderer = env, renderer
        self.detour, self.detours = detour, list(detours)
        self.rng = random.Random(seed)
        self.streams: dict[int, StreamLedger] = {}
        self._sids = itertools.count()
        self.unscored: dict[int, set[int]] = {}  # stream -> positions of detour tokens (no loss)

    async def open(self, stream):
        sid = next(self._sids)
        self.streams[sid] = stream if isinstance(stream, StreamLedger) else StreamLedger(stream)
        return sid

    def ledger(self, sid):
        return self.streams[sid]

    async def append(self, sid, token_ids, source="env"):
        self.streams[sid].append(token_ids, source)

    async def generate(self, sid, params: SamplingParams) -> Generation:
        ledger = self.streams[sid]
        action = self.env.expert_action()
        detour = action is None or self.rng.random() < self.detour
        if detour:
            action = self.rng.choice(self.detours)
        tokens = self.renderer.encode(action) + [self.renderer.eos_ids[0]]
        finish = "stop" if len(tokens) <= params.max_new_tokens else "length"
        tokens = tokens[:params.max_new_tokens]
        for token in tokens:
            ledger.commit(ledger.num_pending)
            ledger.add_sampled(token, 0.0, self.policy_version)  # the expert's choice has probability 1
            if detour:
                self.unscored.setdefault(sid, set()).add(ledger.end - 1)
        return Generation(tokens, [0.0] * len(tokens), finish)

    async def evict(self, sid, spans):
        return len(self.streams[sid].evict(spans).dropped)

    async def prefill(self, sid):
        ledger = self.streams[sid]
        ledger.commit(ledger.num_pending)

    async def close(self, sid, **meta) -> StreamRecord:
        record = self.streams.pop(sid).to_record(**meta)
        unscored = self.unscored.pop(sid, set())
        record.loss_mask = [m and i not in unscored for i, m in enumerate(record.loss_mask)]
        return record


async def expert_records(taskset: TaskSet, renderer: ChatRenderer, renderings: list[CompactionConfig],
                         episode: EpisodeConfig, config: SFTConfig, *, split: str = "train", seed: int = 0,
                         on_episode: Callable[[], None] | None = None, concurrency: int = 32,
                         workers: int = 1) -> list[list[list[StreamRecord]]]:
    """``config.episodes`` expert episodes over the ``split`` games (cycling) under each of ``renderings``: per
    rendering, per episode, its records (one per stream: re-prefill compaction starts a new one), in episode order
    whatever order they finish in. An episode's game is played once, under the first rendering, and replayed for
    the others (``envs.rollout.transcript``; live again where a rendering leaves the recording). Up to
    ``concurrency`` episodes play at once: environments stepped in worker threads (``episode.env_in_thread``) then
    wait on their games together (ALFWorld's player processes). ``workers`` > 1 plays them in that many processes,
    in chunks: TextWorld's step is CPU-bound Python under one lock (its expert's policy update), ~85% of an
    episode's time. Episode ``i`` is seeded ``seed + i`` wherever it plays, so the records do not depend on it.
    ``on_episode`` is called once per episode and rendering."""
    for compaction in renderings:
        if compaction.strategy in ASKS_THE_MODEL:
            raise ValueError(f"SFT from expert episodes needs a strategy that never asks the model; "
                             f"{compaction.strategy!r} does")
    # the games once, here: a worker given the task list never makes them (the first call on a machine generates
    # them; workers asking the taskset each would all generate the same missing games at once)
    args = (taskset, taskset.tasks(split), renderer, list(renderings), episode, config, seed, concurrency)
    if workers <= 1 or config.episodes <= 1:
        played = await _play_expert(*args, range(config.episodes), on_episode)
    else:
        chunk = max(1, min(8, -(-config.episodes // workers)))
        starts = range(0, config.episodes, chunk)
        loop = asyncio.get_running_loop()
        # spawn: the parent may hold a CUDA context, which a forked child must not inherit
        with ProcessPoolExecutor(min(workers, len(starts)), mp_context=multiprocessing.get_context("spawn")) as pool:
            chunks = [loop.run_in_executor(pool, _play_expert_chunk, *args, range(a, min(a + chunk, config.episodes)))
                      for a in starts]
            for done in asyncio.as_completed(chunks):
                for _ in range(len(await done) * len(renderings)):
                    if on_episode is not None:
                        on_episode()
        played = [ep for c in chunks for ep in c.result()]
    return [[ep[k] for ep in played] for k in range(len(renderings))]


def _play_expert_chunk(*args) -> list[list[list[StreamRecord]]]:
    """A worker process's share of ``expert_records``: its episodes, in order."""
    return asyncio.run(_play_expert(*args, None))


async def _play_expert(taskset: TaskSet, tasks: list[Task], renderer: ChatRenderer,
                       renderings: list[CompactionConfig], episode: EpisodeConfig, config: SFTConfig, seed: int,
                       concurrency: int, indices: range,
                       on_episode: Callable[[], None] | None) -> list[list[list[StreamRecord]]]:
    """Per episode, per rendering, its records."""
    sem = asyncio.Semaphore(concurrency)

    async def play(env: Environment, task: Task, compaction: CompactionConfig, i: int) -> list[StreamRecord]:
        client = ExpertClient(env, renderer, detour=config.detour, detours=config.detours, seed=seed + i)
        return (await run_episode(client, env, task, renderer, compaction, episode)).records

    async def one(i: int) -> list[list[StreamRecord]]:
        task, transcript, out = tasks[i % len(tasks)], None, []
        async with sem:
            for compaction in renderings:
                records = None
                if transcript is not None:
                    try:
                        records = await play(TranscriptEnv(transcript), task, compaction, i)
                    except TranscriptMismatch:  # this rendering's episode leaves the recorded game: play it
                        pass
                if records is None:
                    env = taskset.make_env(expert=True)
                    if transcript is None and len(renderings) > 1 and replayable(env):
                        env = RecordingEnv(env)
                    records = await play(env, task, compaction, i)
                    if isinstance(env, RecordingEnv):
                        transcript = env.transcript
                out.append(records)
                if on_episode is not None:
                    on_episode()
        return out

    return list(await asyncio.gather(*(one(i) for i in indices)))


def expert_nll(trainer: Trainer, parts: list[list[StreamRecord]], *, micro_batch: int = 4,
               micro_batch_tokens: int | None = None, backward: bool = False) -> float:
    """Mean over ``parts`` (the renderings) of each part's mean negative logprob of its loss tokens (the
    expert's commands) under the trainer's model; with ``backward`` the gradient of that mean is accumulated.
    Every rendering weighs the same whatever its share of the commands."""
    parts = [p for p in parts if p]
    nll = 0.0
    for part in parts:
        total = sum(sum(r.loss_mask) for r in part) * len(parts)
        for chunk in micro_batches(part, micro_batch, micro_batch_tokens):
            with torch.enable_grad() if backward else torch.no_grad():
                scores = score_streams(trainer.model, chunk, impl=trainer.config.impl)
                loss = -sum(s.logprobs[s.loss_mask].sum() for s in scores) / max(total, 1)
            if backward:
                loss.backward()
            nll += float(loss.detach())
    return nll


def sft_step(trainer: Trainer, parts: list[list[StreamRecord]], *, micro_batch: int = 4,
             micro_batch_tokens: int | None = None) -> dict[str, float]:
    """One optimizer step of cross-entropy on the loss tokens of ``parts`` (a record list per rendering)."""
    trainer.model.train()
    trainer.optimizer.zero_grad(set_to_none=True)
    nll = expert_nll(trainer, parts, micro_batch=micro_batch, micro_batch_tokens=micro_batch_tokens, backward=True)
    grad_norm = torch.nn.utils.clip_grad_norm_(trainer.model.parameters(), trainer.config.grad_clip)
    trainer.optimizer.step()
    records = [r for part in parts for r in part]
    return {"nll": nll, "loss_tokens": float(sum(sum(r.loss_mask) for r in records)),
            "tokens": float(sum(len(r) for r in records)),
            "grad_norm": float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)}


def batches(renderings: list[list[list[StreamRecord]]], size: int, steps: int, *, seed: int = 0,
            length: Callable[[StreamRecord], int] = len) -> list[list[list[StreamRecord]]]:
    """``steps`` batches, each a record list per rendering: the records of ``size`` episodes of that rendering
    (shuffled epochs over its episodes), then thinned to the tokens of the step's smallest part.

    Episodes, not records: a re-prefilled episode is one record per compaction, and sampling records would fill
    a batch with its windows and starve the renderings of one record per episode. Thinned: those windows hold
    ~10x the tokens of the same episode as one KV stream (each re-computes the kept turns), so a part keeps a
    random subset of its records (in order) within the smallest part's tokens -- every rendering costs the same
    compute per step and (``expert_nll``) weighs the same in the loss."""
    rng = random.Random(seed)
    orders: list[list[int]] = [[] for _ in renderings]
    out = []
    for _ in range(steps):
        parts = []
        for episodes, order in zip(renderings, orders, strict=True):
            while len(order) < size:
                epoch = list(range(len(episodes)))
                rng.shuffle(epoch)
                order.extend(epoch)
            parts.append([r for i in order[:size] for r in episodes[i]])
            del order[:size]
        budget = min(sum(map(length, part)) for part in parts)
        for j, part in enumerate(parts):
            if sum(map(length, part)) > budget:
                keep, used, shuffled = set(), 0, list(range(len(part)))
                rng.shuffle(shuffled)
                for i in shuffled:
                    if used + length(part[i]) <= budget:
                        keep.add(i)
                        used += length(part[i])
                parts[j] = [r for i, r in enumerate(part) if i in keep]
        out.append(parts)
    return out


def elapsed(t0: float, device: torch.device) -> float:
    """Seconds since ``t0`` once ``device`` has finished its queued work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return round(time.perf_counter() - t0, 3)


def save_model(trainer: Trainer, base_path: str | Path, out: str | Path) -> Path:
    """Write the trainer's weights as a Hugging Face checkpoint (with the base's tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    model.load_state_dict(trainer.engine_weights())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base_path).save_pretrained(out)
    return out


@dataclass
class WarmStart:
    """What ``warm_start`` made: the SFT checkpoint and how it got there."""

    model_path: str
    steps: int
    episodes: int  # expert episodes trained on (records: one per context window under re-prefill)
    compacted: int  # of which the strategy compacted at least once
    command_tokens: int  # loss tokens over all records
    nll_before: float  # held-out expert command loss (nats/token) before and after
    nll_after: float
    stop_train_win_rate: float | None  # the last early-stop check's train win rate (None: never checked)


class SFTCut(Exception):
    """SFT stopped at its deadline (a device call's time limit) with its state saved: the next call with the same
    config continues from ``steps``."""

    def __init__(self, steps: int):
        super().__init__(f"SFT stopped after step {steps} at the call's deadline, its state saved: call again to "
                         f"continue")
        self.steps = steps


def sft_inputs(cfg: Config, sft: SFTConfig, base_path: str, renderings: list[CompactionConfig],
               games: str | None = None) -> dict:
    """What an SFT's expert episodes and batches depend on, by name (``sft_key`` hashes it; a saved state keeps it,
    so that a mismatch can say what differs). ``games``: the task set's ``games_version``, where it has one."""
    import hashlib
    import json

    # not the step cap (a longer run continues a shorter one), nor the processes playing the episodes; the
    # tokenizer's files, not only the base's path: the records are token ids, and episodes played on another
    # machine (a CPU box, for the device: bench.learning's expert stage) must have been tokenized the same way
    vocab = Path(base_path) / "tokenizer.json"  # its vocabulary, merges and specials; not the writers' versions
    tokenizer = None
    if vocab.exists():
        t = json.loads(vocab.read_text())
        tokenizer = hashlib.sha256(json.dumps([t.get("model"), t.get("added_tokens")], sort_keys=True).encode()
                                   ).hexdigest()
    # nor when the early stop looks (stop_train_win_rate, check_every, check_games): it decides where SFT ends, not
    # what a step trains on
    return {"sft": sft.model_dump(mode="json", exclude={"steps", "expert_workers", "stop_train_win_rate",
                                                        "check_every", "check_games"}),
            "renderings": [c.model_dump(mode="json") for c in renderings],
            "environment": cfg.environment.model_dump(mode="json"), "seed": cfg.run.seed,
            "episode": cfg.orchestrator.episode.model_dump(mode="json"), "base": str(base_path),
            "tokenizer": tokenizer, "games": games}


def sft_key(cfg: Config, sft: SFTConfig, base_path: str, renderings: list[CompactionConfig],
            games: str | None = None) -> str:
    """A saved SFT state (expert episodes, checkpoint) with another key is not resumed."""
    return inputs_key(sft_inputs(cfg, sft, base_path, renderings, games))


def inputs_key(inputs: dict) -> str:
    import hashlib
    import json

    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


async def expert_episodes(cfg: Config, sft: SFTConfig, base_path: str, taskset: TaskSet, renderer: ChatRenderer,
                          out: Path, renderings: list[CompactionConfig], *, console=None) -> tuple[list, list, str]:
    """The SFT's expert episodes, per rendering (each a list of episodes, each its records), the probe's records
    per rendering, and their ``sft_key``: from ``out/expert_episodes.pt`` when its key matches, else played
    (``sft.episodes`` train games and ``sft.probe_episodes`` eval games under each rendering) and saved there."""
    from rich.console import Console
    from rich.progress import Progress

    from . import checkpoint

    console = console or Console()
    games = getattr(taskset, "games_version", None)
    inputs = sft_inputs(cfg, sft, base_path, renderings, games)
    key = inputs_key(inputs)
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "expert_episodes.pt"
    cached = torch.load(cache, weights_only=False) if cache.exists() else None
    if cached is not None and cached.get("key") == key:
        console.print(f"expert episodes from {cache}")
        return cached["episodes"], cached["probe"], key
    if cached is not None:  # say what differs (a state saved before the inputs were kept: cannot tell)
        differ = [k for k in inputs if cached["inputs"].get(k) != inputs[k]] if "inputs" in cached else ["unknown"]
        console.print(f"{cache} was played under other inputs (differs in: {', '.join(differ)}): playing the "
                      f"expert episodes again")
    ep_cfg = episode_config(cfg, temperature=1.0)
    workers = sft.expert_workers or usable_cpus()
    total = (sft.episodes + sft.probe_episodes) * len(renderings)
    done, t0 = 0, time.perf_counter()
    with Progress(transient=True, console=console) as progress:
        bar = progress.add_task("expert episodes", total=total)

        def advance() -> None:
            nonlocal done
            progress.advance(bar)
            done += 1
            if not console.is_terminal and (done * 10 // total > (done - 1) * 10 // total or done == total):
                # a log file sees no live bar: a line every tenth (ALFWorld's 1,000 games take ~half an hour on 2 cores)
                console.print(f"expert episodes {done}/{total} ({time.perf_counter() - t0:.0f}s)")

        # per rendering, per episode, its records; probe: per rendering, its records
        episodes = await expert_records(taskset, renderer, renderings, ep_cfg, sft, split=cfg.environment.train_split,
                                        seed=cfg.run.seed, on_episode=advance, workers=workers)
        probe = [[r for ep in eps for r in ep] for eps in await expert_records(
            taskset, renderer, renderings, ep_cfg, sft.model_copy(update={"episodes": sft.probe_episodes}),
            split=cfg.environment.eval_split, seed=cfg.run.seed + 1, on_episode=advance, workers=workers)]
    buf = io.BytesIO()
    torch.save({"key": key, "inputs": inputs, "episodes": episodes, "probe": probe}, buf)
    checkpoint.atomic_write_bytes(cache, buf.getvalue())
    return episodes, probe, key


async def warm_start(cfg: Config, sft: SFTConfig, base_path: str, taskset: TaskSet, renderer: ChatRenderer,
                     device: torch.device, out: Path, *, console=None,
                     compactions: list[CompactionConfig] | None = None, deadline: float | None = None) -> WarmStart:
    """SFT from ``base_path`` on the train split's expert episodes rendered under ``cfg.compaction``, with the
    early stop of ``sft.stop_train_win_rate`` (greedy play of ``sft.check_games`` train games through the
    run's engine every ``sft.check_every`` steps); ``out/metrics.jsonl``, ``out/metrics.png`` and the
    checkpoint ``out/model``. The expert command loss is measured on ``sft.probe_episodes`` expert episodes
    of the eval split before and after.

    ``compactions``: render ``sft.episodes`` (and the probe's) under each of these instead (the same games), for one
    checkpoint that several runs start from: a model that only ever saw KV-streams contexts (kept turns computed
    while the dropped ones were visible) need not act on re-prefilled ones, and the other way round.

    Resumable: the expert episodes are kept in ``out/expert_episodes.pt`` and the trainer's state in
    ``out/checkpoints`` at every check, so a call cut by a time limit continues from its last check (same
    config, ``sft_key``); anything else starts over. ``deadline`` (``time.monotonic()``: a call's limit, less the
    seconds a checkpoint takes) saves the state after the step that reaches it and raises ``SFTCut``: the next
    call loses no step."""
    from rich.console import Console
    from rich.progress import Progress

    from . import checkpoint

    console = console or Console()
    renderings = compactions or [cfg.compaction]
    episodes, probe, key = await expert_episodes(cfg, sft, base_path, taskset, renderer, out, renderings,
                                                 console=console)
    ckpt_dir = out / "checkpoints"
    records = [r for rendering in episodes for ep in rendering for r in ep]
    compacted = sum(1 for r in records if r.evictions)
    command_tokens = sum(sum(r.loss_mask) for r in records)
    console.print(f"{len(records)} expert episode records ({compacted} compacted), {command_tokens} command tokens")
    trainer = Trainer(base_path, TrainerConfig(lr=sft.lr, micro_batch_records=sft.micro_batch_records,
                                               impl=cfg.trainer.impl, grad_clip=cfg.trainer.grad_clip), device)
    pack = dict(micro_batch=sft.micro_batch_records, micro_batch_tokens=sft.micro_batch_tokens)
    log = MetricsLog(out / "metrics.jsonl")
    state = checkpoint.load_latest(ckpt_dir) if checkpoint.has_checkpoint(ckpt_dir) else None
    if state is not None and state.get("key") == key:
        trainer.load_checkpoint_state(state["trainer"])
        checkpoint.set_rng_state(state["rng"])
        steps, check, nll_before = state["step"], state["check"], state["nll_before"]
        log.truncate_after(steps - 1)
        console.print(f"SFT resumed after step {steps}" + ("" if check is None else
                                                           f" (greedy train wins {check:.0%} at the last check)"))
    else:
        if ckpt_dir.exists():
            shutil.rmtree(ckpt_dir)
        log.path.unlink(missing_ok=True)
        steps, check = 0, None
        nll_before = expert_nll(trainer, probe, **pack)
    train_tasks = taskset.tasks(cfg.environment.train_split)[:sft.check_games]
    checker = None  # the engine that plays the train games for the early stop
    stop = check is not None and sft.stop_train_win_rate is not None and check >= sft.stop_train_win_rate
    with Progress(console=console) as progress:
        bar = progress.add_task("SFT steps", total=sft.steps, completed=steps)
        todo = batches(episodes, sft.episodes_per_step, sft.steps, seed=cfg.run.seed)[steps:]
        for step, batch in enumerate(todo if not stop else [], start=steps):
            t0 = time.perf_counter()
            row = {"step": step, **sft_step(trainer, batch, **pack)}
            row["step_s"] = elapsed(t0, device)
            steps = step + 1
            if sft.stop_train_win_rate is not None and steps % sft.check_every == 0:
                t0 = time.perf_counter()
                checker = checker or make_engine(cfg, base_path, device)
                checker.update_weights(trainer.engine_weights())
                result, _ = await evaluate("SFT check", checker, taskset, train_tasks, renderer, cfg,
                                           temperature=0.0, seed=cfg.run.seed)
                check = row["train_win_rate"] = result.win_rate
                row["check_s"] = elapsed(t0, device)
                stop = check >= sft.stop_train_win_rate
                if not console.is_terminal:  # a log file sees no live bar: one line per check instead
                    console.print(f"SFT step {steps}: nll {row['nll']:.3f}, greedy train wins {check:.0%} "
                                  f"(step {row['step_s']:.2f}s, check {row['check_s']:.1f}s)")
            log.log(row)
            cut = deadline is not None and time.monotonic() >= deadline and steps < sft.steps and not stop
            if "train_win_rate" in row or cut:
                checkpoint.save(ckpt_dir, steps, {"trainer": trainer.checkpoint_state(), "key": key,
                                                  "check": check, "nll_before": nll_before}, keep=2)
            progress.update(bar, advance=1, description=f"SFT steps (nll {row['nll']:.3f})")
            if cut:
                raise SFTCut(steps)
            if stop:
                break
    if stop:
        console.print(f"SFT stops after {steps} steps: greedy policy wins {check:.0%} of "
                      f"{len(train_tasks)} train games")
    del checker
    nll_after = expert_nll(trainer, probe, **pack)
    if steps:
        log.plot(out / "metrics.png", keys=["nll", "grad_norm"])
    model_path = str(save_model(trainer, base_path, out / "model"))
    console.print(f"held-out expert command loss: {nll_before:.3f} -> {nll_after:.3f} nats/token")
    return WarmStart(model_path=model_path, steps=steps, episodes=sft.episodes, compacted=compacted,
                     command_tokens=command_tokens, nll_before=nll_before, nll_after=nll_after,
                     stop_train_win_rate=check)

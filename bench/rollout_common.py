"""Shared by the rollout benchmarks (``bench.rollout_throughput``, ``bench.kv_concentration``):
TextWorld-like episodes replayed on the built-in engine.

- ``EpisodeSpec`` / ``load_episode_pool`` / ``sample_episodes``: turn lengths of real TextWorld
  episodes (``bench/data/textworld_turns.json``, made by ``bench.textworld_lengths``), drawn
  with a seed so that every configuration replays the same episodes.
- ``kv_bytes`` / ``size_pool``: what a KV byte budget buys, measured on the pool classes the
  engine allocates (built on the ``meta`` device: shapes and dtypes, no memory).
- ``Gate``: admission -- an episode starts when its peak KV can be reserved and a batch slot
  is free (continuous refill), or only with a whole new wave (synchronous waves).
- ``replay``: every episode as one coroutine on the engine's async API (``open_stream``,
  ``agenerate`` with forced lengths, ``append``, ``evict`` or close + re-open, ``close``), with
  a ``StepRecorder`` that times each engine step.
- ``shared_model``: one loaded model behind several engines (pool sizes differ per config).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

DATA = Path(__file__).parent / "data" / "textworld_turns.json"
QWEN3_4B = dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                rope_theta=1e6, tie_word_embeddings=True, rms_norm_eps=1e-6)

Strategy = Literal["sliding_window", "full_context"]
Execution = Literal["kv_streams", "reprefill"]


# ---- episodes ----


@dataclass(frozen=True)
class EpisodeSpec:
    """Token counts of one episode: ``first`` (first message + assistant header), then per turn
    ``(action, obs)``: tokens sampled, then tokens appended (0 after the last turn)."""

    first: int
    turns: tuple[tuple[int, int], ...]
    source: str = ""

    @property
    def generated(self) -> int:
        return sum(a for a, _ in self.turns)

    @property
    def total(self) -> int:
        return self.first + sum(a + o for a, o in self.turns)

    def peak_live(self, strategy: Strategy, window: int) -> int:
        """Most tokens the stream holds at once (pending ones included: an upper bound on its
        KV slots) under ``strategy``; Sliding Window evicts the oldest completed turn whenever
        ``window`` completed turns are live (``envs.rollout.compaction.SlidingWindow``, stride 1)."""
        live, peak, turns = self.first, self.first, []
        for a, o in self.turns:
            live += a + o
            peak = max(peak, live)
            if o == 0:
                break
            turns.append(a + o)
            if strategy == "sliding_window" and len(turns) >= window:
                live -= turns.pop(0)
        return peak


def load_episode_pool(path: str | Path = DATA, policies: tuple[str, ...] | None = None) -> list[EpisodeSpec]:
    data = json.loads(Path(path).read_text())
    return [EpisodeSpec(e["first"], tuple(tuple(t) for t in e["turns"]), f"{e['preset']}/{e['policy']}")
            for e in data["episodes"] if policies is None or e["policy"] in policies]


def sample_episodes(pool: list[EpisodeSpec], n: int, seed: int, *, length_scale: float = 1.0,
                    max_turns: int | None = None) -> list[EpisodeSpec]:
    """``n`` episodes drawn with replacement (seeded), token counts scaled by ``length_scale``
    (e.g. ~0.3 for a BPE tokenizer instead of bytes), turns cut at ``max_turns``."""
    rng = random.Random(seed)

    def scale(x: int) -> int:
        return max(1, round(x * length_scale)) if x else 0

    out = []
    for _ in range(n):
        e = pool[rng.randrange(len(pool))]
        turns = list(e.turns[:max_turns] if max_turns else e.turns)
        turns[-1] = (turns[-1][0], 0)  # the episode ends after its last action
        out.append(EpisodeSpec(scale(e.first), tuple((scale(a), scale(o)) for a, o in turns), e.source))
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


# ---- KV bytes ----


def kv_bytes(kind: str, num_layers: int, num_kv_heads: int, head_dim: int, *, dtype=torch.bfloat16,
             sink: int = 16, recent: int = 128) -> dict:
    """Bytes of the engine's pool per token slot and per stream (INT8 side cache rows), measured
    on the pool classes themselves (``meta`` tensors: shapes and dtypes, nothing allocated)."""
    from kvstreams_sglang.streams import FullPrecisionPool, KV4Pool

    def nbytes(slots: int, streams: int) -> int:
        if kind == "bf16":
            return FullPrecisionPool(num_layers, slots, num_kv_heads, head_dim, dtype=dtype, device="meta").nbytes
        return KV4Pool(num_layers, slots, streams, num_kv_heads, head_dim, sink=sink, recent=recent,
                       device="meta").nbytes

    base = nbytes(1, 1)
    per_token = nbytes(2, 1) - base
    per_stream = nbytes(1, 2) - base if kind != "bf16" else 0
    return dict(per_token=per_token, per_stream=per_stream, fixed=base - per_token - per_stream)


def size_pool(budget: int, bytes_: dict, max_batch: int, mean_peak: float) -> tuple[int, int]:
    """``(max_tokens, max_streams)`` of the largest pool that fits ``budget`` bytes: per-stream
    side rows are allocated up front (``KV4Pool``), so the stream count is chosen to maximise
    the episodes that fit at once, ``min(streams, max_tokens / mean_peak)`` (the most streams
    among equals: with no per-stream bytes, bf16 gets ``max_batch``)."""
    best = None
    for streams in range(1, max_batch + 1):
        tokens = (budget - bytes_["fixed"] - streams * bytes_["per_stream"]) // bytes_["per_token"]
        if tokens <= 0:
            break
        fit = min(streams, tokens / mean_peak)
        if best is None or fit >= best[0] - 1e-9:
            best = (max(fit, best[0]) if best else fit, int(tokens), streams)
    if best is None:
        raise ValueError(f"a KV budget of {budget} bytes holds no stream")
    return best[1], best[2]


# ---- engines ----


def build_random_model(shape: dict, device, dtype=torch.bfloat16, seed: int = 0):
    """A random Qwen3 model of ``shape`` built in memory (no checkpoint written)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvstreams_sglang.engine.attention import register

    config = Qwen3Config(**shape)
    with torch.random.fork_rng(devices=[torch.device(device)] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = Qwen3ForCausalLM(config).to(dtype)
    model.set_attn_implementation(register())
    return model.eval()


def load_engine_model(path: str, device, dtype=None):
    from kvstreams_sglang.engine.model_runner import load_model

    return load_model(path, device=torch.device(device), dtype=dtype)[0]


@contextlib.contextmanager
def shared_model(model):
    """Engines created inside use ``model`` instead of loading their ``model_path``."""
    import kvstreams_sglang.engine.model_runner as mr

    original = mr.load_model
    mr.load_model = lambda path, *, device, dtype: (model, model.config)
    try:
        yield
    finally:
        mr.load_model = original


def make_engine(model, kv_dtype: str, *, max_tokens: int, max_streams: int, max_context: int, device,
                sink: int = 16, recent: int = 128):
    from kvstreams_sglang.engine import Engine

    with shared_model(model):
        return Engine("<shared>", kv_dtype=kv_dtype, device=device, kv_slots=max_tokens, max_streams=max_streams,
                      max_context=max_context, sink=sink, recent=recent)


def free_engine(eng) -> None:
    import gc

    eng.pool = eng.backend = eng.slot_table = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- admission ----


class Gate:
    """Admits episodes in index order. Refill: as soon as the next one's peak fits and fewer
    than ``max_batch`` run. Waves: a wave admits up to ``max_batch`` episodes; the next wave
    opens only when every episode of the previous one has finished."""

    def __init__(self, capacity: int, max_batch: int, *, waves: bool = False):
        self.capacity, self.max_batch, self.waves = capacity, max_batch, waves
        self.cond = asyncio.Condition()
        self.next = 0
        self.active = 0
        self.reserved = 0
        self.wave_open, self.wave_size, self.num_waves = True, 0, 0

    def _fits(self, tokens: int) -> bool:
        if self.active >= self.max_batch or self.reserved + tokens > self.capacity:
            return False
        return not self.waves or self.wave_open

    async def acquire(self, index: int, tokens: int) -> None:
        if tokens > self.capacity:
            raise ValueError(f"episode {index} needs {tokens} KV tokens, the pool holds {self.capacity}")
        async with self.cond:
            await self.cond.wait_for(lambda: self.next == index and self._fits(tokens))
            self.next += 1
            self.active += 1
            self.reserved += tokens
            if self.waves:
                if self.wave_size == 0:
                    self.num_waves += 1
                self.wave_size += 1
                if self.wave_size >= self.max_batch:
                    self.wave_open = False
            self.cond.notify_all()

    async def release(self, tokens: int) -> None:
        async with self.cond:
            self.active -= 1
            self.reserved -= tokens
            if self.waves and self.active == 0:
                self.wave_open, self.wave_size = True, 0
            self.cond.notify_all()


# ---- step timing ----


@dataclass
class StepLog:
    mode: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)  # streams computed in the step
    tokens: list[int] = field(default_factory=list)  # tokens computed in the step
    live: list[int] = field(default_factory=list)  # resident KV tokens after the step
    active: list[int] = field(default_factory=list)  # admitted episodes during the step
    max_live: list[int] = field(default_factory=list)  # longest kept context among the step's streams

    def summary(self) -> dict:
        dec = [i for i, m in enumerate(self.mode) if m == "decode"]
        ext = [i for i, m in enumerate(self.mode) if m == "extend"]
        wall = sum(self.seconds)

        def mean(xs, idx):
            return statistics.fmean(xs[i] for i in idx) if idx else 0.0

        allidx = range(len(self.mode))
        return dict(
            steps=len(self.mode), decode_calls=len(dec), extend_calls=len(ext),
            mean_decode_batch=mean(self.batch, dec), mean_extend_batch=mean(self.batch, ext),
            mean_step_ms=1000 * mean(self.seconds, allidx), mean_decode_step_ms=1000 * mean(self.seconds, dec),
            mean_extend_step_ms=1000 * mean(self.seconds, ext),
            mean_resident_kv_tokens=mean(self.live, allidx), mean_resident_kv_tokens_decode=mean(self.live, dec),
            mean_active_episodes=mean(self.active, allidx),
            time_weighted_active_episodes=(sum(a * s for a, s in zip(self.active, self.seconds, strict=True)) / wall
                                           if wall else 0.0),
            step_seconds=wall, decode_seconds=sum(self.seconds[i] for i in dec),
        )


class StepRecorder:
    """Wraps ``eng.step``: mode, wall time (a step ends in a device-to-host copy of the sampled
    tokens, so host time is device time), streams and tokens computed, resident KV."""

    def __init__(self, eng, gate: Gate | None = None):
        self.eng, self.gate, self.log = eng, gate, StepLog()
        self._step = eng.step
        eng.step = self.step

    def step(self) -> None:
        eng = self.eng
        reqs = list(eng._requests.values())
        if not reqs:
            return self._step()
        streams = [eng.table.get(r.sid) for r in reqs]
        before = [st.ledger.num_computed for st in streams]
        extend = any(st.ledger.num_pending > 1 or r.params is None for st, r in zip(streams, reqs, strict=True))
        mode = "extend" if extend else "decode"
        n0 = eng.stats.tokens_prefilled + eng.stats.tokens_decoded
        t0 = time.perf_counter()
        self._step()
        dt = time.perf_counter() - t0
        log = self.log
        log.mode.append(mode)
        log.seconds.append(dt)
        log.batch.append(sum(st.ledger.num_computed != b for st, b in zip(streams, before, strict=True)))
        log.tokens.append(eng.stats.tokens_prefilled + eng.stats.tokens_decoded - n0)
        log.live.append(eng.stats.live_slots)
        log.active.append(self.gate.active if self.gate is not None else len(reqs))
        log.max_live.append(max(st.ledger.num_live for st in streams))


# ---- replay ----


@dataclass
class ReplayConfig:
    strategy: Strategy = "sliding_window"
    execution: Execution = "kv_streams"
    window: int = 4  # Sliding Window: live completed turns that trigger evicting the oldest one
    max_batch: int = 64
    waves: bool = False
    seed: int = 0


@dataclass
class ReplayResult:
    wall_s: float
    episodes: int
    generated: int
    reprefilled: int
    evicted: int
    peak_open_streams: int
    log: StepLog
    episode_peaks: list[int] = field(default_factory=list)  # most KV slots each episode's stream held (measured)
    episode_reserved: list[int] = field(default_factory=list)  # what admission reserved for it


async def replay(eng, episodes: list[EpisodeSpec], cfg: ReplayConfig, capacity: int, *, vocab: int = 256,
                 on_done=None) -> ReplayResult:
    """Run every episode on ``eng`` (async API), admitted through a ``Gate`` of ``capacity``
    KV tokens. Action lengths are forced (``max_new_tokens``, no stop token); token ids are
    random (seeded per episode). Re-prefill execution closes the stream at each compaction and
    re-opens it on the kept tokens; every kept token that had been computed is counted as
    re-prefilled (``envs.rollout.agent_loop.StreamConversation.evict``)."""
    from kvstreams_sglang.engine import SamplingParams

    gate = Gate(capacity, cfg.max_batch, waves=cfg.waves)
    rec = StepRecorder(eng, gate)
    counts = dict(reprefilled=0, evicted=0, open=0, peak_open=0)
    peaks, reserved = [0] * len(episodes), [ep.peak_live(cfg.strategy, cfg.window) for ep in episodes]

    async def one(i: int, ep: EpisodeSpec) -> None:
        need = reserved[i]
        await gate.acquire(i, need)
        try:
            rng = random.Random(cfg.seed * 1_000_003 + i)
            tokens = [rng.randrange(vocab) for _ in range(ep.first)]  # the current stream's tokens
            sid = eng.open_stream(tokens)
            counts["open"] += 1
            counts["peak_open"] = max(counts["peak_open"], counts["open"])
            turns: list[tuple[int, int]] = []  # live completed turns, stream positions
            for t, (a, o) in enumerate(ep.turns):
                start = len(tokens)  # stream position: kv_streams keeps every token's, re-prefill renumbers
                g = await eng.agenerate(sid, SamplingParams(max_new_tokens=a, seed=cfg.seed * 7919 + 131 * i + t))
                tokens.extend(g.token_ids)
                peaks[i] = max(peaks[i], eng.live_tokens(sid))  # a stream's slots peak at the end of a generation
                if o == 0:
                    break
                obs = [rng.randrange(vocab) for _ in range(o)]
                eng.append(sid, obs)
                tokens.extend(obs)
                turns.append((start, len(tokens)))
                if cfg.strategy == "sliding_window" and len(turns) >= cfg.window:
                    s, e = turns.pop(0)
                    counts["evicted"] += e - s
                    if cfg.execution == "kv_streams":
                        eng.evict(sid, [(s, e)])
                    else:  # close the context window, re-open a fresh stream on the kept tokens
                        pending = o + 1  # the appended observation and the last sampled token
                        kept = tokens[:s] + tokens[e:]
                        counts["reprefilled"] += len(kept) - pending
                        eng.close(sid)
                        sid = eng.open_stream(kept)
                        tokens = kept
                        turns = [(x - (e - s), y - (e - s)) for x, y in turns]
            eng.close(sid)
            counts["open"] -= 1
        finally:
            await gate.release(need)
        if on_done is not None:
            on_done()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, ep) for i, ep in enumerate(episodes)))
    wall = time.perf_counter() - t0
    eng.step = rec._step
    return ReplayResult(wall_s=wall, episodes=len(episodes), generated=sum(e.generated for e in episodes),
                        reprefilled=counts["reprefilled"], evicted=counts["evicted"],
                        peak_open_streams=counts["peak_open"], log=rec.log, episode_peaks=peaks,
                        episode_reserved=reserved)


def warm_up(eng, *, n: int = 4, seed: int = 99) -> None:
    """Compile / warm every kernel the replay uses (extend and decode at a few batch sizes)."""
    eps = [EpisodeSpec(40 + 8 * i, ((3 + i, 20 + i), (4, 30), (5, 0)), "warmup") for i in range(n)]
    cap = eng.table.allocator.num_slots
    asyncio.run(replay(eng, eps, ReplayConfig(strategy="sliding_window", window=2, max_batch=n, seed=seed), cap))
    eng.stats.peak_slots = eng.stats.live_slots


def decode_split_variants(log: StepLog, kv_dtype: str, num_kv_heads: int, *, sink: int = 16, recent: int = 128,
                          block_n: int = 64, target_programs: int = 1024) -> list[int]:
    """The split counts ``kernels.plan_decode`` picks over the recorded decode steps (each distinct
    value is a Triton specialisation of the decode kernels, compiled on first use). kv4rl: the
    longest INT4 list is taken as the longest context minus its ``sink + recent`` INT8 positions."""
    out = set()
    for mode, b, live in zip(log.mode, log.batch, log.max_live, strict=True):
        if mode != "decode":
            continue
        n = max(0, live - (sink + recent)) if kv_dtype == "kv4rl" else live
        want = max(1, math.ceil(target_programs / max(1, b * num_kv_heads)))
        out.add(max(1, min(want, -(-n // block_n))))
    return sorted(out)


# H200, Qwen3-4B shape, eager HF forward (bench/results/engine_throughput_h200.json: 68 / 84 ms per decode
# step at 64 x 4k, mostly host overhead; prefill 29k / 19k tokens/s): a deliberately conservative model
STEP_MS = {"bf16": 65.0, "kv4rl": 80.0}
PREFILL_TOK_S = {"bf16": 29000.0, "kv4rl": 19000.0}


def estimate_gpu_seconds(log: StepLog, kv_dtype: str) -> float:
    """What the recorded schedule would take on the H200 (see ``STEP_MS``, ``PREFILL_TOK_S``)."""
    t = 0.0
    for mode, n in zip(log.mode, log.tokens, strict=True):
        t += STEP_MS[kv_dtype] / 1000 + (n / PREFILL_TOK_S[kv_dtype] if mode == "extend" else 0.0)
    return t


def fmt_bytes(n: float) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def device_name(device) -> str:
    d = torch.device(device)
    return torch.cuda.get_device_name(d) if d.type == "cuda" else "cpu"


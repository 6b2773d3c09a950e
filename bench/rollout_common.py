"""The built-in engine side of the rollout benchmarks (``bench.rollout_throughput``, ``bench.kv_concentration``).

Episodes are replayed through the real agent loop (``bench.replay``); this holds what the built-in engine adds:

- ``kv_bytes`` / ``size_pool``: what a KV byte budget buys, from the pools' own bytes per token
  (``FullPrecisionPool.bytes_per_token``, ``KV4Pool.bytes_per_token`` / ``side_bytes_per_token``).
- ``load_engine_model`` / ``make_engine``: one loaded model behind several engines (``Engine(model=...)``;
  pool sizes differ per configuration).
- ``StepLog``: every engine step as the engine reports it (``Engine.on_step``), with the gate's admitted
  episodes at that step.
- ``warm_up``, ``decode_split_variants`` and an H200 time model of a recorded schedule (``estimate_gpu_seconds``).
"""

from __future__ import annotations

import asyncio
import gc
import math
import statistics
from dataclasses import dataclass, field

import torch

from kvstreams_sglang.engine import StepInfo

from .replay import EpisodeSpec, Gate, Replay, run_replay

# ---- KV bytes ----


def kv_bytes(kind: str, num_layers: int, num_kv_heads: int, head_dim: int, *, dtype=torch.bfloat16,
             sink: int = 16, recent: int = 128) -> dict:
    """Bytes of a pool per token slot and per stream: ``kv4rl`` (the INT8 side cache's ``side_width(sink, recent)``
    slots per stream, allocated up front by ``KV4Pool``), else K and V in ``dtype`` (bf16, fp8, ...)."""
    from kvstreams_sglang.kv4 import side_width
    from kvstreams_sglang.streams import FullPrecisionPool, KV4Pool

    if kind != "kv4rl":
        return dict(per_token=FullPrecisionPool.bytes_per_token(num_layers, num_kv_heads, head_dim, dtype),
                    per_stream=0)
    return dict(per_token=KV4Pool.bytes_per_token(num_layers, num_kv_heads, head_dim),
                per_stream=side_width(sink, recent) * KV4Pool.side_bytes_per_token(num_layers, num_kv_heads, head_dim))


def size_pool(budget: int, bytes_: dict, max_batch: int, mean_peak: float) -> tuple[int, int]:
    """``(max_tokens, max_streams)`` of the largest pool that fits ``budget`` bytes: per-stream
    side rows are allocated up front (``KV4Pool``), so the stream count is chosen to maximise
    the episodes that fit at once, ``min(streams, max_tokens / mean_peak)`` (the most streams
    among equals: with no per-stream bytes, bf16 gets ``max_batch``)."""
    best = None
    for streams in range(1, max_batch + 1):
        tokens = (budget - streams * bytes_["per_stream"]) // bytes_["per_token"]
        if tokens <= 0:
            break
        fit = min(streams, tokens / mean_peak)
        if best is None or fit >= best[0] - 1e-9:
            best = (max(fit, best[0]) if best else fit, int(tokens), streams)
    if best is None:
        raise ValueError(f"a KV budget of {budget} bytes holds no stream")
    return best[1], best[2]


# ---- engines ----


def load_engine_model(path: str, device, dtype=None):
    from kvstreams_sglang.engine.model_runner import load_model

    return load_model(path, device=torch.device(device), dtype=dtype)[0]


def make_engine(model, kv_dtype: str, *, max_tokens: int, max_streams: int, max_context: int, device,
                sink: int = 16, recent: int = 128, on_step=None):
    from kvstreams_sglang.engine import Engine

    return Engine(model=model, kv_dtype=kv_dtype, device=device, kv_slots=max_tokens, max_streams=max_streams,
                  max_context=max_context, sink=sink, recent=recent, on_step=on_step)


def free_engine(eng) -> None:
    eng.pool = eng.backend = eng.slot_table = eng.runner = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- step timing ----


@dataclass
class StepLog:
    """The engine's steps (``Engine.on_step``: mode, wall time, streams and tokens computed, resident KV after
    the step, the longest kept context among the step's streams) and the episodes admitted at each."""

    gate: Gate | None = None
    mode: list[str] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    live: list[int] = field(default_factory=list)
    active: list[int] = field(default_factory=list)
    max_live: list[int] = field(default_factory=list)

    def record(self, info: StepInfo) -> None:
        self.mode.append(info.mode)
        self.seconds.append(info.seconds)
        self.batch.append(info.streams)
        self.tokens.append(info.tokens)
        self.live.append(info.live_slots)
        self.active.append(self.gate.active if self.gate is not None else info.streams)
        self.max_live.append(info.max_stream_slots)

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


def run_logged(eng, episodes: list[EpisodeSpec], replay: Replay, gate: Gate, reservations: list[int], *,
               on_done=None):
    """Replay ``episodes`` on the built-in engine ``eng`` (``BuiltinClient``) through ``gate``; returns the
    finished episodes and the engine's ``StepLog``."""
    from envs.rollout.client import BuiltinClient

    log = StepLog(gate)
    eng.on_step = log.record
    try:
        done = asyncio.run(run_replay(BuiltinClient(eng), enumerate(episodes), replay, gate,
                                      reservations=dict(enumerate(reservations)),
                                      on_episode=(lambda _: on_done()) if on_done is not None else None))
    finally:
        eng.on_step = None
    return done, log


def warm_up(eng, replay: Replay, *, n: int = 4) -> None:
    """Run every kernel the replay uses once (extend and decode at a few batch sizes)."""
    from envs.rollout.compaction import CompactionConfig

    t = replay.template
    eps = [EpisodeSpec(t.first + 40 + 8 * i, ((4 + i, t.obs + 20 + i), (5, t.obs + 30), (6, 0)), "warmup")
           for i in range(n)]
    small = Replay(replay.renderer, CompactionConfig(strategy="sliding_window", window_turns=2, stride=1),
                   replay.config, seed=99)
    cap = eng.table.allocator.num_slots
    run_logged(eng, eps, small, Gate(cap, n), [1] * n)
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

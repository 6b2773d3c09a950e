"""Learning curves per GPU-second (issue 24): held-out win rate against the GPU time spent training, for
KV-streams + kv4rl vs re-prefill + BF16 vs full context + BF16, all from one SFT checkpoint.

Stages, each skipped when an earlier call finished it (state under ``--out-dir``):

1. ``expert`` (no GPU; ``sft`` does it too when it has not been done): the games, the tokenizer, the model and the
   SFT's expert episodes. A CPU box can play them before a device call: ``bash bench/device/sft_inputs.sh ENV``.
   ``sft``: the tokenizer (byte-level BPE learnt on the train split's expert episodes) and the random Qwen3
   model (``[model.tiny]``, ``harness.run.prepare_model``), then SFT on expert episodes rendered under each
   run's compaction (``harness.sft.warm_start``: one checkpoint for all three; trained on KV-streams contexts
   alone, the first H200 run's SFT model won 42/64 held-out games under KV-streams and 0/64 under
   re-prefill); the checkpoint's sha256 is recorded.
2. ``kv_streams``, ``reprefill``, ``full_context``: async GRPO (``harness.run.run``) from that checkpoint,
   same seed, same GPU-time budget (``run.time_budget_s``), each with the settings of ``RUNS`` over the
   config. Each run evaluates the held-out splits (``[evaluation]``) at its start, every
   ``evaluation.every`` steps and at its end; its GPU time is the wall time of its steps (rollouts and
   training overlap; weight syncs; the drains before evaluations), evaluation excluded.
3. ``fidelity`` (``[fidelity]``; empty ``lengths`` skips it): sampler fidelity at length of the SFT checkpoint,
   ``D_sampler`` of KV8 / KV4 / KV4 + 16 sink + 128 recent against BF16 (``bench.sampler_fidelity``) on streams of
   recorded TextWorld games played back to back, one measurement per length (default 4k and 16k tokens).
4. the report (every call, whatever got done): ``--json`` (default ``OUT_DIR/learning.json``) with the
   evaluation points, the commands, the config, the checkpoints' hashes and the targets of ``[targets]``
   met or missed by how much, and a PNG beside it (win rate vs GPU-seconds, a line per run). Written
   atomically.

Rollouts run on the built-in engine (``kvstreams_sglang.engine``) by default, or with ``--serving.engine sglang``
on an SGLang server per run (``[serving]``): on the device the SGLang bundle and the environments' wheels do not fit
one call's carry together, so ``bench/device/learning_check.sh`` installs them in separate calls on one warm machine.

The SFT checkpoint (hundreds of MB at ~100M parameters) never travels: a run stage needs ``OUT_DIR/sft/model``
from an earlier stage of the same machine, or SFT is done again (same seed, same data); every run records the
sha256 of the checkpoint it started from and the report says whether the three match.

    python -m bench.learning --config configs/textworld/gpu_small.toml --out-dir runs/learning/textworld \\
        [--stage all|expert|sft|kv_streams|reprefill|full_context|fidelity|report ...] [--json PATH] \\
        [--section.key value ...]
    python -m bench.learning merge A.json B.json --out C.json   # runs finished in different calls or machines
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import json
import os
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field

from harness import checkpoint
from harness.config import Config, ConfigError, Section, apply_overrides, check_machine, load_config
from harness.sft import SFTConfig, SFTCut

# What each run changes in the config (dotted keys, as on the command line); the rest is shared.
RUNS: dict[str, dict[str, str]] = {
    "kv_streams": {"compaction.execution": "kv_streams", "inference.kv_dtype": "kv4rl"},
    "reprefill": {"compaction.execution": "reprefill", "inference.kv_dtype": "bf16"},
    "full_context": {"compaction.strategy": "full_context", "inference.kv_dtype": "bf16"},
}
STAGES = ("expert", "sft", *RUNS, "fidelity")


class TargetsConfig(Section):
    """Issue 24's targets; a report says of each whether it was met, and by how much it was missed."""

    rl_lift: float = Field(0.10, description="kv_streams' final held-out win rate minus its SFT start (absolute)")
    gpu_s_ratio: float = Field(0.5, gt=0, description="kv_streams' GPU-seconds to re-prefill's final win rate, "
                               "over re-prefill's own (time to first reach it), at most this")
    full_context_gap: float | None = Field(0.05, ge=0, description="kv_streams' final win rate at most this "
                                           "below full_context's (None: not a target)")


class FidelityConfig(Section):
    """Sampler fidelity at length (``bench.sampler_fidelity``) of the SFT checkpoint: ``D_sampler`` of KV8, KV4 and
    KV4 + 16 sink + 128 recent against BF16 on streams of recorded games played back to back."""

    lengths: list[int] = Field([4096, 16384], description="one measurement per entry: streams of at least this many "
                               "tokens (empty: no fidelity stage)")
    episodes: int = Field(8, ge=1, description="streams per length")
    max_new_tokens: int = Field(12, ge=1, description="longest sampled command")


class ServingConfig(Section):
    """Where the RL runs' rollouts are generated. ``sglang``: each run gets its own server, ours
    (``kvstreams_sglang.launch_server --enable-kv-streams``, plus ``--kv4rl`` where the run's ``inference.kv_dtype``
    is kv4rl), on the run's starting checkpoint with SGLang's CUDA graphs; the harness drives it as
    ``--inference.engine sglang``, sends it every policy update from disk with ``flush_cache=False`` and plays the
    held-out games on it too (``evaluation.on_server``; not the run's time). A server's start is not the run's GPU
    time either; the report records it."""

    engine: Literal["builtin", "sglang"] = Field("builtin", description="builtin: kvstreams_sglang.engine in "
                                                 "the bench's process; sglang: a server per run")
    mem_fraction_static: float = Field(0.3, gt=0, lt=1, description="the server's share of GPU memory at most (the "
                                       "trainer shares the device); its KV pool is the run's inference.kv_slots")
    max_total_tokens: int = Field(65536, ge=1024, description="the server's KV pool on the CPU (CI), in tokens")
    flags: list[str] = Field([], description="more launch_server flags, as on its command line")
    start_timeout_s: float = Field(900.0, gt=0)
    start_during_sft: bool = Field(True, description="start the first RL run's server while SFT trains, on the base "
                                   "checkpoint (its CUDA graph captures and first-use compiles overlap SFT)")


class LearningConfig(Config):
    sft: SFTConfig = SFTConfig()
    targets: TargetsConfig = TargetsConfig()
    fidelity: FidelityConfig = FidelityConfig()
    serving: ServingConfig = ServingConfig()


def tree_sha256(path: str | Path) -> str:
    """sha256 over a checkpoint directory: every file's relative name and bytes, in name order."""
    h = hashlib.sha256()
    root = Path(path)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.atomic_write_bytes(path, json.dumps(data, indent=1).encode())


def read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def run_config(cfg: LearningConfig, name: str, model_path: str, output_dir: Path, url: str | None = None) -> Config:
    """The harness config of run ``name``: the shared config with ``RUNS[name]`` applied, from ``model_path``;
    with ``url``, its rollouts on the SGLang server there."""
    data = cfg.model_dump(mode="json", exclude={"sft", "targets", "fidelity", "serving"})
    settings = {**RUNS[name], "model.path": model_path, "run.output_dir": str(output_dir)}
    if url is not None:
        settings.update({"inference.engine": "sglang", "inference.url": url})
    return Config.model_validate(apply_overrides(data, [f"--{k}={v}" for k, v in settings.items()]))


def rollout_server(cfg: Config, serving: ServingConfig, log_path: Path):
    """The SGLang server of a run whose config is ``cfg`` (not started): KV-streams always (re-prefill opens a new
    stream per context window, full context never evicts), kv4rl with the run's sink and recent windows, room for
    the run's streams, logprobs from an fp32 LM head as the trainer computes them."""
    from harness.trainer import free_port

    from .sglang_servers import OURS, Server, ServerConfig, cpu_flags_env

    i, ep = cfg.inference, cfg.orchestrator.episode
    # a stream's positions reach max_stream_tokens plus a turn, within what the model has positions for (SGLang
    # refuses a longer context than the checkpoint's)
    config = Path(cfg.model.path) / "config.json"
    positions = json.loads(config.read_text()).get("max_position_embeddings") if config.exists() else None
    context = min(ep.max_stream_tokens + ep.max_new_tokens + 64, positions or 1 << 62)
    flags = ["--enable-kv-streams", "--enable-fp32-lm-head", "--max-running-requests", str(i.max_streams),
             "--context-length", str(context), "--random-seed", str(cfg.run.seed),
             "--log-level-http", "warning"]  # not 3-4 access lines a turn (7.6 MB in a 100 s re-prefill run)
    if i.kv_dtype == "kv4rl":
        flags += ["--kv4rl", "--kv4rl-sink", str(i.sink), "--kv4rl-recent", str(i.recent)]
    elif i.kv_dtype != "bf16":
        raise ConfigError(f"serving.engine = 'sglang' runs kv4rl or bf16 KV, not {i.kv_dtype!r}")
    env = {}
    if i.device == "cpu":
        cpu_flags, env = cpu_flags_env(serving.max_total_tokens)
        flags += cpu_flags
    else:  # the built-in engine's KV budget (inference.kv_slots), within the memory share: both engines hold as
        # many tokens, and the rest of the share stays free for the trainer
        flags += ["--mem-fraction-static", str(serving.mem_fraction_static), "--max-total-tokens", str(i.kv_slots),
                  "--dtype", "bfloat16"]  # as the trainer and the built-in engine (auto: fp16 for fp32 checkpoints)
        # A batch whose rows sample differently (greedy turns, SGLang's top_k = 1, beside T = 1 rows) takes SGLang's
        # top-k path, FlashInfer's JIT-compiled kernel by default: on a fresh H100 (2026-12-06) its first use
        # stalled the kv_streams run's server through the rest of the call. The clients now send prefill-only rows
        # with their stream's sampling (client.prefill_sampling), so the runs' batches agree; should one not,
        # PyTorch's top-k over this vocabulary costs nothing that matters, and nothing compiles in a 10-minute call.
        flags += ["--sampling-backend", "pytorch"]
        if i.kv_dtype == "bf16":  # FlashInfer, as the rollout bench's bf16 servers: SGLang's Hopper default, FA3,
            # is not in the device's sglang-kernel (sm90 common_ops only: the first bf16 run died importing it)
            flags += ["--attention-backend", "flashinfer"]
    return Server(ServerConfig(log_path.stem, OURS), cfg.model.path, free_port(), log_path,
                  flags=[*flags, *serving.flags], env=env)


async def warm_up(url: str, cfg: Config) -> None:
    """Streams as the run drives them -- a 300-token prompt, a turn, an eviction, an observation, a turn over the
    INT4 prefix -- with the run's sampling and greedy, before the run's clock starts. A fresh machine JIT-compiles
    kernels at their first use: on the first GPU run of ``--serving.engine sglang`` (2026-12-06) the step-0
    evaluation stalled 113 s at its first extends over a prefix; that is the server's start, not the run's time."""
    from kvstreams_sglang.engine import SamplingParams
    from kvstreams_sglang.sglang_ext.client import SGLangClient

    ep = cfg.orchestrator.episode
    client = SGLangClient(url, kv_dtype=cfg.inference.kv_dtype)
    try:
        for temperature in (ep.temperature, 0.0):
            params = SamplingParams(max_new_tokens=ep.max_new_tokens, temperature=temperature, top_p=ep.top_p,
                                    top_k=ep.top_k, seed=cfg.run.seed)
            sid = await client.open([1 + i % 60 for i in range(300)], shared_prefix_len=0)
            await client.generate(sid, params)
            await client.evict(sid, [(100, 140)])
            await client.append(sid, [1 + i % 60 for i in range(40)])
            await client.generate(sid, params)
            await client.close(sid)
    finally:
        await client.aclose()


class LearningBench:
    """The bench's state directory and its stages."""

    def __init__(self, cfg: LearningConfig, out_dir: Path, console=None):
        from rich.console import Console

        from harness.run import resolve_device

        self.cfg, self.out = cfg, Path(out_dir)
        self.console = console or Console()
        self.device = resolve_device(cfg.inference.device)
        self.pending_runs: list[str] = []  # the RL runs this call will do, in order (main_async)
        self._early = None  # (run, its server, the task starting it): started during SFT (start_early)
        self.deadline: float | None = None  # time.monotonic() at which SFT saves its state and the call ends

    def stage_done(self, stage: str) -> bool:
        if stage == "expert":
            return (self.out / "sft" / "expert_episodes.pt").exists()
        return (self.out / (f"runs/{stage}" if stage in RUNS else stage) / "done.json").exists()

    # --- stage 1 ---------------------------------------------------------------------------------------
    @property
    def sft_model(self) -> Path:
        return self.out / "sft" / "model"

    @contextlib.contextmanager
    def base_and_games(self):
        """The base model (built here the first time: tokenizer and random weights), the environment's taskset and
        the chat renderer; the taskset closed after."""
        from transformers import AutoTokenizer

        from envs.registry import make_taskset
        from envs.rollout.chat import ChatRenderer
        from harness.run import prepare_model

        torch.manual_seed(self.cfg.run.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        base = prepare_model(self.cfg, self.out)
        e = self.cfg.environment
        taskset = make_taskset(e.name, e.options)
        try:
            yield base, taskset, ChatRenderer(AutoTokenizer.from_pretrained(base), taskset.make_env().system_prompt)
        finally:
            close = getattr(taskset, "close", None)
            if close is not None:
                close()

    async def expert(self) -> None:
        """The games, the tokenizer, the model and the SFT's expert episodes (``sft/expert_episodes.pt``), without
        training: no GPU needed. A CPU box plays them before a device call (``bench/device/sft_inputs.sh``), and
        the device's SFT uses them when its tokenizer is the same (``harness.sft.sft_key``)."""
        from harness.sft import expert_episodes

        if read_json(self.out / "sft" / "done.json") is not None:
            return  # SFT is done: its episodes are not needed any more
        with self.base_and_games() as (base, taskset, renderer):
            await expert_episodes(self.cfg, self.cfg.sft, base, taskset, renderer, self.out / "sft",
                                  self.renderings(base), console=self.console)

    async def sft(self) -> dict:
        """Tokenizer, model and SFT; ``sft/done.json`` (hashes, steps, losses, seconds). Kept when done and its
        checkpoint is here; done again when only the record came back (another machine)."""
        from harness.sft import warm_start

        done = read_json(self.out / "sft" / "done.json")
        if done is not None and (self.sft_model / "config.json").exists():
            return done
        self.console.rule("[bold]SFT: tokenizer, model, expert episodes" + (" (again: no checkpoint here)"
                                                                           if done else ""))
        t0 = time.perf_counter()
        with self.base_and_games() as (base, taskset, renderer):
            t_model = time.perf_counter() - t0
            self.start_early(base)
            try:
                ws = await warm_start(self.cfg, self.cfg.sft, base, taskset, renderer, self.device,
                                      self.out / "sft", console=self.console, compactions=self.renderings(base),
                                      deadline=self.deadline)
            except BaseException:
                self.stop_early()
                raise
        record = {**asdict(ws), "base_sha256": tree_sha256(base), "sft_sha256": tree_sha256(ws.model_path),
                  "parameters": parameter_count(base), "model_and_games_s": round(t_model, 1),
                  "seconds": round(time.perf_counter() - t0, 1),
                  "earlier_sft_sha256": (done or {}).get("earlier_sft_sha256", []) + (
                      [done["sft_sha256"]] if done else [])}
        write_json(self.out / "sft" / "done.json", record)
        self.console.print(f"SFT checkpoint {ws.model_path}: sha256 {record['sft_sha256'][:16]}..., "
                           f"{record['seconds']:.0f}s")
        return record

    def start_early(self, base: str) -> None:
        """With ``--serving.engine sglang`` (``serving.start_during_sft``): start the next RL run's server now, on
        the base checkpoint, so that its start (CUDA graph captures, first-use compiles: 125 s on a fresh H100,
        2026-12-06) overlaps SFT instead of following it. The run gives its server the SFT weights before anything
        else (``harness.run`` updates the policy at its start), and the warm-up's cache is flushed (``rl``)."""
        if self.cfg.serving.engine != "sglang" or not self.cfg.serving.start_during_sft:
            return
        name = next((n for n in self.pending_runs if not self.stage_done(n)), None)
        if name is None:
            return
        server = rollout_server(run_config(self.cfg, name, base, self.run_dir(name)), self.cfg.serving,
                                self.run_dir(name).parent / f"{name}.server.log")
        self.run_dir(name).parent.mkdir(parents=True, exist_ok=True)
        self.console.print(f"starting {name}'s server during SFT (log {server.log_path})")
        server.launch()  # here, so that stop_early always finds its process
        ready = asyncio.ensure_future(asyncio.to_thread(server.wait_ready, self.cfg.serving.start_timeout_s))
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # a stopped start's error: not a warning
        self._early = (name, server, ready)

    def stop_early(self) -> None:
        if self._early is not None:
            self._early[1].stop()
            self._early = None

    async def take_early(self, name: str):
        """Run ``name``'s server started during SFT, once up; None where there is none (or it failed to start:
        the run then starts its own)."""
        if self._early is None or self._early[0] != name:
            self.stop_early()
            return None
        _, server, starting = self._early
        self._early = None
        try:
            await starting
        except Exception as e:  # said, and the run starts a server of its own
            self.console.print(f"{name}'s server started during SFT failed ({e!r}): starting it again")
            server.stop()
            return None
        return server

    def renderings(self, base: str) -> list:
        """The runs' distinct compactions: the one SFT checkpoint learns from expert episodes rendered under each."""
        out = []
        for name in RUNS:
            compaction = run_config(self.cfg, name, base, self.out).compaction
            if compaction not in out:
                out.append(compaction)
        return out

    # --- stage 2 ---------------------------------------------------------------------------------------
    def run_dir(self, name: str) -> Path:
        return self.out / "runs" / name

    async def rl(self, name: str) -> dict:
        """One RL run from the SFT checkpoint; resumed from its last checkpoint when an earlier call was cut."""
        from harness.run import run

        done = read_json(self.run_dir(name) / "done.json")
        if done is not None:
            return done
        sft = await self.sft()
        out = self.run_dir(name)
        resume = checkpoint.has_checkpoint(out / "checkpoints")
        self.console.rule(f"[bold]RL: {name} ({', '.join(f'{k} = {v}' for k, v in RUNS[name].items())})"
                          + (" resumed" if resume else ""))
        rcfg = run_config(self.cfg, name, str(self.sft_model), out)
        t0 = time.perf_counter()
        server, start_s = None, None
        early = False
        if self.cfg.serving.engine == "sglang":
            server = await self.take_early(name)
            early = server is not None
            if server is None:
                server = rollout_server(rcfg, self.cfg.serving, out.parent / f"{name}.server.log")  # beside the run
                self.console.print(f"starting {' '.join(server.command()[1:4])} ... (log {server.log_path})")
                try:
                    await asyncio.to_thread(server.start, self.cfg.serving.start_timeout_s)
                except BaseException:  # cancelled (SIGTERM: main's unwind_on_sigterm) while the thread waits
                    server.stop()
                    raise
            await warm_up(server.url, rcfg)
            if early:  # its warm-up ran the base weights: nothing of it may be matched by the run's prompts
                await asyncio.to_thread(server.flush_cache)
            start_s = round(time.perf_counter() - t0, 1)
            self.console.print(f"server up and warm in {start_s} s at {server.url}")
            rcfg = run_config(self.cfg, name, str(self.sft_model), out, url=server.url)
        host = None
        try:
            rows = await run(rcfg, resume=resume, overwrite=not resume, overlap=True)
            if server is not None:  # where the server's scheduler spent its host time (seconds per hook)
                host = await asyncio.to_thread(server.host_clock)
        finally:
            if server is not None:
                server.stop()
        record = {"sft_sha256": sft["sft_sha256"], "settings": RUNS[name], "steps": len(rows), "scheduler_host": host,
                  "gpu_s": rows[-1]["gpu_s"] if rows else 0.0, "wall_s": round(time.perf_counter() - t0, 1),
                  "resumed": resume, "engine": self.cfg.serving.engine, "server_start_s": start_s,
                  "server_started_during_sft": early,
                  # the trainer's first-use compiles before the clock, per process that ran the run (harness.run)
                  "trainer_warm_up_s": [round(r["trainer_warm_up_s"], 1) for r in rows if "trainer_warm_up_s" in r],
                  "server_flags": server.command()[4:] if server is not None else None,
                  "device": device_name(self.device)}
        write_json(out / "done.json", record)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return record

    async def fidelity(self) -> dict:
        """``D_sampler`` of the SFT checkpoint per ``[fidelity]`` length; ``fidelity/done.json``."""
        from bench import sampler_fidelity

        done = read_json(self.out / "fidelity" / "done.json")
        if done is not None:
            return done
        sft = await self.sft()
        f = self.cfg.fidelity
        self.console.rule(f"[bold]Sampler fidelity at length: streams of >= {f.lengths} tokens")
        record = {"sft_sha256": sft["sft_sha256"], "lengths": {}}
        for length in f.lengths:
            t0 = time.perf_counter()
            res = sampler_fidelity.run(str(self.sft_model), self.device, episodes=f.episodes,
                                       max_new_tokens=f.max_new_tokens, seed=self.cfg.run.seed, check_episodes=0,
                                       min_tokens=length, system_prompt=self.cfg.environment.options.get(
                                           "system_prompt"), log=self.console.print)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            record["lengths"][str(length)] = res
        write_json(self.out / "fidelity" / "done.json", record)
        return record

    # --- stage 3 ---------------------------------------------------------------------------------------
    def points(self, name: str) -> list[dict]:
        """The run's evaluations, one point per step: win rate over all eval splits and per split."""
        by_step: dict[int, dict] = {}
        path = self.run_dir(name) / "eval.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
        for r in rows:
            p = by_step.setdefault(r["step"], {"step": r["step"], "gpu_s": round(r["gpu_s"], 2), "splits": {},
                                               # how the rollouts stopped for it, and the seconds that took
                                               # (None: the start, or a row from before 2026-12-07)
                                               "drained": r.get("drained"), "stop_s": r.get("stop_s")})
            p["splits"][r["split"]] = {k: r[k] for k in ("episodes", "wins", "win_rate", "mean_reward",
                                                          "mean_turns", "tokens_reprefilled", "peak_kv_tokens")}
            p["splits"][r["split"]]["seconds"] = r.get("seconds")  # its wall time (rows before 2026-12-06: none)
        for p in by_step.values():
            s = p["splits"].values()
            p["episodes"], p["wins"] = sum(x["episodes"] for x in s), sum(x["wins"] for x in s)
            p["win_rate"] = p["wins"] / max(1, p["episodes"])
        return [by_step[k] for k in sorted(by_step)]

    def run_summary(self, name: str) -> dict:
        path = self.run_dir(name) / "metrics.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
        points = self.points(name)
        # the run's clock at its end: a step's row is written before the drain (or pause) that precedes an
        # evaluation (and a checkpoint), so the last evaluation's clock, after it, may be the later one
        gpu_s = max([r["gpu_s"] for r in rows[-1:]] + [p["gpu_s"] for p in points[-1:]], default=0.0)
        return {
            "settings": RUNS[name], "done": read_json(self.run_dir(name) / "done.json"), "points": points,
            # the evaluations' wall time, outside the runs' GPU time (call time all the same)
            "eval_s": round(sum(x["seconds"] or 0.0 for p in points for x in p["splits"].values()), 1),
            "steps": len(rows), "gpu_s": gpu_s, "gpu_s_per_step": round(gpu_s / len(rows), 2) if rows else None,
            "tokens_generated": sum(r["tokens_generated"] for r in rows),
            "tokens_reprefilled": sum(r["tokens_reprefilled"] for r in rows),
            "peak_live_kv_tokens": max((r["peak_live_kv_tokens"] for r in rows), default=0),
            "rollout_s": round(sum(r["rollout_s"] for r in rows), 1),
            "train_s": round(sum(r["train_s"] for r in rows), 1),
            # the rollouts stopped before the evaluations (drained or paused: run.drain_at_checkpoint), on the clock
            "stop_s": round(sum(p["stop_s"] or 0.0 for p in points), 1),
            "max_lag": max((r["max_lag"] for r in rows), default=0),
            "train_win_rate_last": rows[-1]["win_rate"] if rows else None,
        }

    def report(self, json_path: Path, commands: list[dict]) -> dict:
        runs = {name: self.run_summary(name) for name in RUNS}
        sft = read_json(self.out / "sft" / "done.json")
        started_from = {n: (r["done"] or {}).get("sft_sha256") for n, r in runs.items()}
        known = {h for h in started_from.values() if h}
        report = {
            "environment": self.cfg.environment.name,
            "device": device_name(self.device),
            "engine": ("builtin (kvstreams_sglang.engine)" if self.cfg.serving.engine == "builtin" else
                       "sglang (a kvstreams_sglang.launch_server per run, held-out games on it too)"),
            "gpu_seconds": "wall seconds of each run's RL steps on the one device (rollouts and training, "
                           "overlapped; weight syncs; drains before evaluations); held-out evaluation excluded",
            "stages_done": [s for s in STAGES if self.stage_done(s)],
            "commands": commands,
            "config": self.cfg.model_dump(mode="json"),
            "checkpoints": {"base_sha256": (sft or {}).get("base_sha256"), "sft_sha256": (sft or {}).get("sft_sha256"),
                            "runs_started_from": started_from, "same_sft_checkpoint": len(known) <= 1},
            "sft": sft,
            "runs": runs,
            "targets": targets({n: r["points"] for n, r in runs.items()}, self.cfg.targets,
                               finished={n: r["done"] is not None for n, r in runs.items()},
                               devices={n: (r["done"] or {}).get("device") for n, r in runs.items()}),
            "sampler_fidelity": fidelity_summary(read_json(self.out / "fidelity" / "done.json")),
        }
        write_json(json_path, report)
        plot(json_path.with_suffix(".png"), report)
        return report


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def fidelity_summary(done: dict | None) -> dict | None:
    """Per length: the streams' tokens, mean D_sampler per configuration, and how much the INT8 sink + recent
    protection lowers KV4's (the KV4-RL paper: 7.0x)."""
    if done is None:
        return None
    out = {"sft_sha256": done["sft_sha256"], "paper_ratio": 7.0, "lengths": {}}
    for length, res in done["lengths"].items():
        out["lengths"][length] = {"stream_tokens": res["stream_tokens"], "prefixes": res["configs"]["kv8"]["prefixes"],
                                  "mean_kl": {k: v["mean_kl"] for k, v in res["configs"].items()},
                                  "ratio_unprotected_over_protected": res["ratio_unprotected_over_protected"],
                                  "seconds": res.get("seconds")}
    return out


def parameter_count(model_path: str | Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters())


def first_reach(points: list[dict], win_rate: float) -> float | None:
    """GPU-seconds at the first evaluation whose win rate is at least ``win_rate`` (None: never)."""
    return next((p["gpu_s"] for p in points if p["win_rate"] >= win_rate - 1e-9), None)


def targets(points: dict[str, list[dict]], t: TargetsConfig, finished: dict[str, bool] | None = None,
            devices: dict[str, str | None] | None = None) -> dict:
    """Each target: met (None when the runs cannot tell yet), the numbers, and what is short.

    ``finished``: which runs spent their budget (default: all). A target on a run cut before its end is not judged
    (a cut run's last point is not its final one): its numbers so far stay, as ``provisional_met``. ``devices``:
    the GPU each run ran on, where recorded; GPU-seconds from two kinds of GPU are not compared."""
    kv, rp, fc = points["kv_streams"], points["reprefill"], points["full_context"]
    finished = dict.fromkeys(points, True) if finished is None else finished
    devices = devices or {}
    out: dict[str, dict] = {}
    if len(kv) >= 2:
        lift = kv[-1]["win_rate"] - kv[0]["win_rate"]
        out["rl_lift"] = {"target": t.rl_lift, "sft_win_rate": kv[0]["win_rate"], "final_win_rate": kv[-1]["win_rate"],
                          "lift": lift, "met": lift >= t.rl_lift - 1e-9, "short_by": max(0.0, t.rl_lift - lift)}
    else:
        out["rl_lift"] = {"target": t.rl_lift, "met": None, "why": "kv_streams has fewer than 2 evaluations"}
    if len(kv) >= 2 and len(rp) >= 2:
        goal = rp[-1]["win_rate"]
        t_rp, t_kv = first_reach(rp, goal), first_reach(kv, goal)
        entry = {"target_max_ratio": t.gpu_s_ratio, "win_rate_to_reach": goal, "reprefill_gpu_s": t_rp,
                 "kv_streams_gpu_s": t_kv}
        if not t_rp:
            entry.update(met=False, why="re-prefill's final win rate is its starting one: no time to compare")
        elif kv[0]["win_rate"] >= goal - 1e-9:
            # each run's held-out games play under its own compaction: re-prefill's start can sit below kv_streams'
            entry.update(met=None, kv_streams_start=kv[0]["win_rate"], reprefill_start=rp[0]["win_rate"],
                         why=f"kv_streams starts at {kv[0]['win_rate']:.3f}, already re-prefill's final {goal:.3f} "
                             f"(re-prefill started at {rp[0]['win_rate']:.3f}): no RL time to compare")
        elif t_kv is None:
            best = max(p["win_rate"] for p in kv)
            entry.update(met=False, why=f"kv_streams never reached it (best {best:.3f}, short by {goal - best:.3f})")
        else:
            ratio = t_kv / t_rp
            entry.update(ratio=ratio, speedup=t_rp / t_kv if t_kv else None, met=ratio <= t.gpu_s_ratio + 1e-9,
                         short_by=max(0.0, ratio - t.gpu_s_ratio))
        out["gpu_s_to_reprefill_final"] = entry
    else:
        out["gpu_s_to_reprefill_final"] = {"target_max_ratio": t.gpu_s_ratio, "met": None,
                                           "why": "kv_streams or reprefill has fewer than 2 evaluations"}
    if t.full_context_gap is not None:
        if len(kv) >= 2 and len(fc) >= 2:
            gap = fc[-1]["win_rate"] - kv[-1]["win_rate"]
            out["vs_full_context"] = {"target_max_gap": t.full_context_gap, "kv_streams_final": kv[-1]["win_rate"],
                                      "full_context_final": fc[-1]["win_rate"], "gap": gap,
                                      "met": gap <= t.full_context_gap + 1e-9,
                                      "short_by": max(0.0, gap - t.full_context_gap)}
        else:
            out["vs_full_context"] = {"target_max_gap": t.full_context_gap, "met": None,
                                      "why": "kv_streams or full_context has fewer than 2 evaluations"}
    runs_of = {"rl_lift": ("kv_streams",), "gpu_s_to_reprefill_final": ("kv_streams", "reprefill"),
               "vs_full_context": ("kv_streams", "full_context")}
    for key, entry in out.items():
        if entry["met"] is None:
            continue
        cut = [n for n in runs_of[key] if not finished.get(n, False)]
        gpus = {devices.get(n) for n in runs_of[key]} - {None}
        if cut:
            entry.update(provisional_met=entry["met"], met=None,
                         why=f"{' and '.join(cut)} not finished: numbers so far")
        elif key == "gpu_s_to_reprefill_final" and len(gpus) > 1:
            entry.update(provisional_met=entry["met"], met=None,
                         why=f"the runs' GPU-seconds come from different GPUs ({', '.join(sorted(gpus))})")
    return out


def plot(path: Path, report: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4))
    styles = {"kv_streams": ("#c63", "KV-streams + kv4rl"), "reprefill": ("#69c", "re-prefill + BF16"),
              "full_context": ("#777", "full context + BF16")}
    for name, run in report["runs"].items():
        pts = run["points"]
        if pts:
            color, label = styles[name]
            cut = run["done"] is None  # cut by a call's limit: its budget not spent yet
            ax.plot([p["gpu_s"] for p in pts], [p["win_rate"] for p in pts], marker="o", color=color,
                    linestyle="--" if cut else "-", label=label + (" (not finished)" if cut else ""))
    splits = report["config"]["evaluation"]["splits"] or [report["config"]["environment"]["eval_split"]]
    ax.set_xlabel(f"GPU-seconds ({report['device']})")
    ax.set_ylabel(f"held-out win rate ({' + '.join(splits)}, greedy)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{report['environment']}: learning per GPU-second", fontsize=10)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def merge(parts: list[Path], out: Path) -> dict:
    """One report from reports of the same bench (same config, same SFT checkpoint) whose runs were done in
    different calls or on different machines: a run's checkpoints never travel, so a run finished on a machine
    handed back stays in the report that machine wrote. Each run is taken from the first part where it finished
    (else from the part where it got furthest), and the targets are judged again over the runs taken."""
    reports = [read_json(p) for p in parts]
    for p, r in zip(parts, reports, strict=True):
        if r is None:
            raise SystemExit(f"error: {p}: no report there")
    first = reports[0]
    for p, r in zip(parts[1:], reports[1:], strict=True):
        if r["environment"] != first["environment"]:
            raise SystemExit(f"error: {p} is {r['environment']}, {parts[0]} is {first['environment']}")
        diff = config_diff(first["config"], r["config"])
        if diff:
            raise SystemExit(f"error: {p} and {parts[0]} ran different configs ({', '.join(diff)}): not one bench")
    shas = {r["checkpoints"]["sft_sha256"] for r in reports} - {None}
    if len(shas) > 1:
        raise SystemExit(f"error: the parts started from different SFT checkpoints ({', '.join(sorted(shas))}): "
                         "their runs do not compare")

    def furthest(name: str) -> int:
        runs = [r["runs"][name] for r in reports]
        done = [i for i, run in enumerate(runs) if run["done"] is not None]
        return done[0] if done else max(range(len(runs)), key=lambda i: runs[i]["gpu_s"])

    taken = {name: furthest(name) for name in RUNS}
    runs = {name: dict(reports[i]["runs"][name], taken_from=str(parts[i])) for name, i in taken.items()}
    fidelity = next((r["sampler_fidelity"] for r in reports if r.get("sampler_fidelity")), None)
    devices = {n: (run["done"] or {}).get("device") for n, run in runs.items()}
    merged = dict(
        {k: v for k, v in first.items() if k not in ("rescored", "merged_from")},
        device=" / ".join(dict.fromkeys(r["device"] for r in reports)),
        stages_done=[s for s in STAGES if any(s in r["stages_done"] for r in reports)],
        commands=[{"report": str(p), **c} for p, r in zip(parts, reports, strict=True) for c in r["commands"]],
        sft=next((r["sft"] for r in reports if r.get("sft")), None),
        runs=runs,
        targets=targets({n: run["points"] for n, run in runs.items()}, TargetsConfig(**first["config"]["targets"]),
                        finished={n: run["done"] is not None for n, run in runs.items()}, devices=devices),
        sampler_fidelity=fidelity,
        merged_from=[str(p) for p in parts])
    started_from = {n: (run["done"] or {}).get("sft_sha256") for n, run in runs.items()}
    merged["checkpoints"] = dict(first["checkpoints"], sft_sha256=next(iter(shas), None),
                                 runs_started_from=started_from,
                                 same_sft_checkpoint=len(set(started_from.values()) - {None}) <= 1)
    write_json(out, merged)
    plot(out.with_suffix(".png"), merged)
    return merged


def config_diff(a: dict, b: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two configs (as dumped in reports)."""
    keys = sorted(set(a) | set(b))
    out = []
    for k in keys:
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += config_diff(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}")
    return out


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="other --section.key value arguments override the config")
    p.add_argument("--config", required=True, help="TOML: the harness's sections plus [sft] and [targets]")
    p.add_argument("--out-dir", type=Path, required=True, help="state: model, SFT checkpoint, the runs")
    p.add_argument("--json", type=Path, default=None, help="the report (default OUT_DIR/learning.json); PNG beside")
    p.add_argument("--stage", nargs="+", default=["all"], choices=["all", *STAGES, "report"],
                   help="stages to run if not done yet (all: every one, in order); the report is always written")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds this call may take (a device call's limit, less a margin): SFT saves its state "
                        "after the step that reaches it and the call ends there, with its report; the next call "
                        "continues from that step")
    p.add_argument("--run-min-s", type=float, default=0.0,
                   help="with --deadline-s: an RL run starts (or resumes) only while this many seconds remain before "
                        "the deadline (its server's start, an evaluation, a step and the next evaluation); else the "
                        "call ends there, its device time not spent on a start the next call would repeat")
    return p.parse_known_args(argv)


async def main_async(args: argparse.Namespace, cfg: LearningConfig, command: str) -> dict:
    bench = LearningBench(cfg, args.out_dir)
    if args.deadline_s is not None:
        bench.deadline = time.monotonic() + args.deadline_s
    log = args.out_dir / "commands.jsonl"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stages = list(STAGES) if "all" in args.stage else [s for s in STAGES if s in args.stage]
    with open(log, "a") as f:
        f.write(json.dumps({"command": command, "stages": stages, "device_command": os.environ.get(
            "LEARNING_DEVICE_COMMAND"), "started": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
    json_path = args.json or args.out_dir / "learning.json"
    commands = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    bench.pending_runs = [s for s in stages if s in RUNS]
    try:
        for stage in stages:
            if stage == "fidelity" and not cfg.fidelity.lengths:
                continue
            left = None if bench.deadline is None else bench.deadline - time.monotonic()
            if stage in RUNS and not bench.stage_done(stage) and left is not None and left < args.run_min_s:
                bench.console.print(f"{stage} not started: {max(left, 0):.0f} s to the call's deadline, a run needs "
                                    f"{args.run_min_s:.0f} (--run-min-s): call again")
                break
            await (bench.expert() if stage == "expert" else bench.sft() if stage == "sft"
                   else bench.fidelity() if stage == "fidelity" else bench.rl(stage))
            bench.report(json_path, commands)
    except SFTCut as cut:
        bench.console.print(str(cut))
    finally:
        bench.stop_early()  # a server started during SFT for a run this call did not reach
        report = bench.report(json_path, commands)
    bench.console.print(summary_table(report))
    bench.console.print(f"report {json_path} and {json_path.with_suffix('.png')}")
    return report


def summary_table(report: dict):
    from rich.table import Table

    t = Table(title=f"{report['environment']}: held-out win rate (start -> final) per GPU-second")
    for col in ("run", "evaluations", "start", "final", "GPU-s", "RL steps", "tokens re-prefilled"):
        t.add_column(col, justify="right")
    for name, run in report["runs"].items():
        pts = run["points"]
        t.add_row(name, str(len(pts)), f"{pts[0]['win_rate']:.3f}" if pts else "-",
                  f"{pts[-1]['win_rate']:.3f}" if pts else "-", f"{run['gpu_s']:.1f}", str(run["steps"]),
                  str(run["tokens_reprefilled"]))
    verdict = {True: "met", False: "not met", None: "cannot tell"}
    t.caption = "; ".join(f"{key}: {verdict[target['met']]}" + (
        f" (so far {verdict[target['provisional_met']]}: {target['why']})" if "provisional_met" in target else "")
        for key, target in report["targets"].items())
    return t


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:  # python -m bench.learning merge A.json B.json --out C.json
        p = argparse.ArgumentParser(prog="python -m bench.learning merge", description=merge.__doc__.split("\n\n")[0])
        p.add_argument("parts", nargs="+", type=Path, help="reports; a run is taken from the first that finished it")
        p.add_argument("--out", type=Path, required=True, help="the merged report; PNG beside")
        m = p.parse_args(argv[1:])
        merged = merge(m.parts, m.out)
        from rich.console import Console

        Console().print(summary_table(merged))
        return 0
    args, overrides = parse_args(argv)
    from .sglang_servers import unwind_on_sigterm

    unwind_on_sigterm()  # a run's SGLang server (own process group) must not outlive a timed-out bench
    try:
        cfg = load_config(args.config, overrides, schema=LearningConfig)
        check_machine(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    asyncio.run(main_async(args, cfg, shlex.join(["python", "-m", "bench.learning", *argv])))
    return 0


if __name__ == "__main__":
    sys.exit(main())

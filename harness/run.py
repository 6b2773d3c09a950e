"""Entry point: ``python -m harness.run CONFIG.toml [--section.key value ...] [--resume | --overwrite]``.

Wires the three roles of prime-rl's layout: inference (the built-in engine; SGLang
through the same client), the orchestrator (asyncio rollouts) and the trainer (FSDP2).
Each step: wait for ``T`` fresh groups, train on them (in a worker thread while rollouts
keep going, unless ``--no-overlap``), push the weights to the engine without touching its
KV, log metrics, checkpoint at a drained point. One process, or ``torchrun
--nproc-per-node N -m harness.run ...``: N trainer ranks, rank 0 also running the
orchestrator and the engine on ``inference.device`` (see ``distributed.py``).

Everything that can be checked up front is, before the run directory is touched: the config
(``config.py``), the machine (model checkpoint, device), and the run directory itself (a
fresh run needs an unused one, ``--resume`` a checkpoint in it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from envs.registry import make_taskset
from envs.rollout.chat import ChatRenderer

from . import checkpoint
from .config import Config, ConfigError, check_machine, load_config
from .distributed import TrainerRanks, follow, on_device, trainer_device
from .evaluate import HeldOut
from .inference import make_inference
from .loss import group_advantages
from .metrics import MetricsLog
from .orchestrator import Group, Orchestrator
from .trainer import Trainer, TrainSample, init_distributed


def resolve_device(name: str) -> torch.device:
    """``auto`` / ``cpu`` / ``cuda[:N]`` as a device with an index on CUDA (``torch.cuda.set_device`` and the
    per-thread device guards need one; a bare ``cuda`` means the current device)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def prepare_model(cfg: Config, out: Path, *, build: bool = True) -> str:
    """The checkpoint every role loads: ``model.path``, or the tiny model built (by rank 0
    only, ``build``) under the run directory."""
    if cfg.model.path:
        return cfg.model.path
    path = out / "model"
    if build and not (path / "config.json").exists():
        from kvstreams_sglang.checkpoints import build_tiny_model

        t = cfg.model.tiny
        corpus = None
        # a BPE tokenizer already here came with expert episodes played on another machine (tokenized with it:
        # bench/device/sft_inputs.sh): the model is built around it, not around one learnt again here
        keep = t.vocab == "bpe" and (path / "tokenizer.json").is_file()
        if t.vocab == "bpe" and not keep:
            from envs.corpus import episode_texts
            from envs.cpus import usable_cpus

            e = cfg.environment
            corpus = episode_texts(make_taskset(e.name, e.options), e.train_split, workers=usable_cpus())
        build_tiny_model(path, num_layers=t.num_layers, hidden_size=t.hidden_size, num_heads=t.num_heads,
                         num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, intermediate_size=t.intermediate_size,
                         vocab=t.vocab, corpus=corpus, vocab_size=t.vocab_size, seed=t.seed, keep_tokenizer=keep)
    return str(path)


# What a run writes into run.output_dir (*.tmp: MetricsLog.truncate_after's, weights: the SGLang engine's)
RUN_ENTRIES = {"config.json", "model", "metrics.jsonl", "metrics.tmp", "metrics.png", "checkpoints", "weights",
               "eval.jsonl", "eval.tmp"}


def claim_output_dir(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuse, before anything is written, what would mix two runs in one directory: a fresh
    run into a used one would append its steps to the old ``metrics.jsonl`` (steps 0, 0, ...)
    and train the old run's model; ``--resume`` with nothing to resume from would quietly
    start at step 0. ``overwrite`` clears a used run directory (and nothing else). A fresh run's
    directory is then created here, so that one that cannot be is a one-line error too."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite exclude each other")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"run.output_dir {out} is a file, not a directory")
    if resume:
        if not checkpoint.has_checkpoint(out / "checkpoints"):
            raise ConfigError(f"--resume: no checkpoint in {out / 'checkpoints'}")
        return
    used = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if used and not overwrite:
        raise ConfigError(f"run.output_dir {out} already holds a run ({', '.join(used)}): pass --resume to "
                          f"continue it or --overwrite to start over")
    foreign = [name for name in used if name not in RUN_ENTRIES]
    if foreign:
        raise ConfigError(f"--overwrite: {out} is not a run directory (it holds {', '.join(foreign)}); clear it "
                          f"yourself or pick another run.output_dir")
    if used:
        shutil.rmtree(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"run.output_dir: cannot create {out} ({e.strerror})") from None


def batch_digest(groups: list[Group]) -> str:
    """Fingerprint of what a step trained on: which rollouts, their tokens, versions and rewards."""
    h = hashlib.sha256()
    for g in groups:
        for r in g.rollouts:
            for rec in r.records:
                h.update(json.dumps([g.group_id, rec.token_ids, rec.policy_versions, r.reward]).encode())
    return h.hexdigest()[:16]


def step_metrics(step: int, groups: list[Group], train: dict, timing: dict, orch: Orchestrator) -> dict:
    rollouts = [r for g in groups for r in g.rollouts]
    lags: dict[str, int] = {}
    for r in rollouts:
        lag = str(step - r.min_version)
        lags[lag] = lags.get(lag, 0) + 1
    s = [r.stats for r in rollouts]
    gen = sum(x["tokens_generated"] for x in s)
    turns = sum(x["turns"] for x in s)
    return {
        "step": step, "reward": sum(r.reward for r in rollouts) / len(rollouts),
        "win_rate": sum(r.won for r in rollouts) / len(rollouts),
        "response_tokens_per_turn": gen / max(1, turns), "turns": turns / len(rollouts),
        "tokens_generated": gen, "tokens_reprefilled": sum(x["tokens_reprefilled"] for x in s),
        "peak_live_kv_tokens": max(x["peak_live_tokens"] for x in s),
        "mean_live_kv_tokens": sum(x["mean_live_tokens"] for x in s) / len(s),
        "compactions": sum(x["compactions"] for x in s), "pick_fallbacks": sum(x["pick_fallbacks"] for x in s),
        # where the step's episodes spent their time, summed over episodes (they overlap: episode-seconds, not
        # wall): waiting on the engine, on tools (environment steps but grading), on grading
        "episode_generate_s": sum(x.get("generate_s", 0.0) for x in s),
        "episode_tool_s": sum(x.get("env_s", 0.0) - x.get("grade_s", 0.0) for x in s),
        "episode_grade_s": sum(x.get("grade_s", 0.0) for x in s),
        "lag_histogram": lags, "max_lag": max(int(k) for k in lags),
        "stale_groups_dropped": orch.stale_groups, "stale_rollouts_dropped": orch.stale_rollouts,
        "tokens_per_s": gen / max(timing["rollout_s"] + timing["train_s"], 1e-9),
        "env_steps_per_s": turns / max(timing["rollout_s"] + timing["train_s"], 1e-9),
        "batch_digest": batch_digest(groups), "group_ids": [g.group_id for g in groups], **timing, **train,
    }


def build_trainer(cfg: Config, *, resume: bool) -> tuple[Trainer, str, dict | None]:
    """Every rank: read the latest intact checkpoint when resuming (before writing anything),
    join the process group, load the model (rank 0 builds it first), restore the trainer's
    part of the checkpoint."""
    out = Path(cfg.run.output_dir)
    state = None
    if resume:
        try:
            state = checkpoint.load_latest(out / "checkpoints")
        except checkpoint.CorruptCheckpoint as e:
            raise ConfigError(f"--resume: {e}") from None
        if state is None:
            raise ConfigError(f"--resume: no checkpoint in {out / 'checkpoints'}")
    device = trainer_device(resolve_device(cfg.inference.device))
    init_distributed(device)
    if dist.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(cfg.model_dump_json(indent=1))
        prepare_model(cfg, out)
    dist.barrier()
    model_path = prepare_model(cfg, out, build=False)
    torch.manual_seed(cfg.run.seed)
    trainer = Trainer(model_path, cfg.trainer, device)
    if state is not None:
        with on_device(device):
            trainer.load_checkpoint_state(state["trainer"])
    return trainer, model_path, state


async def sync_weights(inference, trainer: TrainerRanks, orch: Orchestrator, version: int, reprefill: bool) -> int:
    """Push the trainer's weights to the engine; the KV of running streams is kept, unless
    ``reprefill``: then carried episodes' KV is recomputed under the new policy (KV4-RL's
    choice). Returns the tokens recomputed."""
    await inference.update_weights(trainer.engine_weights(), version)
    return await orch.client.reprefill_streams() if reprefill else 0


async def run(cfg: Config, *, resume: bool = False, overwrite: bool = False, overlap: bool = True) -> list[dict]:
    """Rank 0 (or the only process): orchestrator, engine and the trainer group's lead."""
    out = Path(cfg.run.output_dir)
    claim_output_dir(out, resume=resume, overwrite=overwrite)
    trainer_rank0, model_path, state = build_trainer(cfg, resume=resume)
    trainer = TrainerRanks(trainer_rank0)
    device = resolve_device(cfg.inference.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this thread drives the engine
    inference = make_inference(cfg.inference, model_path, device, out)
    await inference.start()
    taskset = make_taskset(cfg.environment.name, cfg.environment.options, processes=cfg.environment.processes)
    try:
        return await _train(cfg, out, trainer, model_path, state, device, inference, taskset, overlap)
    finally:
        close = getattr(taskset, "close", None)
        if close is not None:
            close()


async def _train(cfg: Config, out: Path, trainer, model_path: str, state, device, inference, taskset,
                 overlap: bool) -> list[dict]:
    """``run``'s loop, once the trainer, the engine and the task set are up."""
    from rich.progress import Progress
    from transformers import AutoTokenizer

    env = taskset.make_env()
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_path), env.system_prompt)
    env.close()
    orch = Orchestrator(cfg.orchestrator, cfg.compaction, inference.client, taskset, renderer,
                        split=cfg.environment.train_split, seed=cfg.run.seed)
    metrics = MetricsLog(out / "metrics.jsonl")
    eval_log = MetricsLog(out / "eval.jsonl")
    on_server = cfg.inference.engine == "sglang" and cfg.evaluation.on_server
    held_out = (HeldOut(cfg, model_path, device, taskset, renderer, client=inference.client if on_server else None)
                if cfg.evaluation.every else None)
    start, gpu_s = 0, 0.0  # gpu_s: the run's time on its devices (steps, drains, pauses; evaluation excluded)
    if state is not None:
        orch.load_state_dict(state["orchestrator"])
        checkpoint.set_rng_state(state["rng"])
        start, gpu_s = state["step"], state.get("gpu_s", 0.0)
        metrics.truncate_after(start - 1)
        eval_log.truncate_after(start)
    await inference.update_weights(trainer.engine_weights(), start)
    warm_up_s = trainer.warm_up()  # the trainer's compiles before the clock, as the servers' (first row: its seconds)

    async def evaluate_at(step: int, **stop) -> None:
        for result in await held_out.evaluate(trainer.engine_weights()):
            eval_log.log({"step": step, "gpu_s": gpu_s, "split": result.stage, "on_server": on_server, **stop,
                          **result.as_dict()})

    if held_out is not None and not any(r["step"] == start for r in eval_log.rows()):
        await evaluate_at(start)  # the starting policy (a resumed run evaluated at its checkpoint already)
    budget = cfg.run.time_budget_s
    drain = cfg.run.drain_at_checkpoint
    with Progress() as progress:
        # a time-budgeted run ends on its GPU-seconds, not its step count: the bar counts what ends it
        bar = (progress.add_task("RL steps", total=cfg.run.steps, completed=start) if budget is None else
               progress.add_task(f"RL GPU-s of {budget:g}", total=budget, completed=min(gpu_s, budget)))
        for step in range(start, cfg.run.steps):
            if budget is not None and gpu_s >= budget:
                break  # resumed from the checkpoint that spent the budget
            t0 = time.perf_counter()
            groups = await orch.batch(step)
            orch.fill()  # keep the pool full while training
            t1 = time.perf_counter()
            samples = []
            for g in groups:
                for r, adv in zip(g.rollouts, group_advantages([r.reward for r in g.rollouts]), strict=True):
                    samples.extend(TrainSample(rec, adv) for rec in r.records)
            train = await asyncio.to_thread(trainer.train_step, samples) if overlap else trainer.train_step(samples)
            t2 = time.perf_counter()
            recomputed = await sync_weights(inference, trainer, orch, step + 1, cfg.orchestrator.reprefill_on_update)
            t3 = time.perf_counter()
            gpu_s += t3 - t0
            row = step_metrics(step, groups, train, {"rollout_s": t1 - t0, "train_s": t2 - t1, "sync_s": t3 - t2},
                               orch)
            row.update(inference.metrics())
            row["tokens_reprefilled_on_update"] = recomputed
            row["tokens_reprefilled"] += recomputed
            row["gpu_s"] = gpu_s
            if step == start:
                row["trainer_warm_up_s"] = warm_up_s
            if device.type == "cuda":
                row["engine_peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            metrics.log(row)
            if budget is None:
                progress.update(bar, advance=1, description=f"RL steps (reward {row['reward']:.3f})")
            else:
                progress.update(bar, completed=min(gpu_s, budget),
                                description=f"RL GPU-s of {budget:g} (step {step + 1}, reward {row['reward']:.3f})")
            last = step + 1 == cfg.run.steps or (budget is not None and gpu_s >= budget)
            evaluate_now = held_out is not None and ((step + 1) % cfg.evaluation.every == 0 or last)
            if evaluate_now or (step + 1) % cfg.run.checkpoint_every == 0 or last:
                # the groups in flight finish (drain_at_checkpoint) or stop in place, on the run's time; then
                # nothing runs while the checkpoint is written and the held-out games are played
                t = time.perf_counter()
                await (orch.drain() if drain else orch.pause())
                stop_s = time.perf_counter() - t
                gpu_s += stop_s
                checkpoint.save(out / "checkpoints", step + 1, {"trainer": trainer.checkpoint_state(),
                                                               "orchestrator": orch.state_dict(), "gpu_s": gpu_s},
                                keep=cfg.run.keep_checkpoints)
                if evaluate_now:
                    await evaluate_at(step + 1, drained=drain, stop_s=round(stop_s, 3))
                orch.resume()
            if last:
                break
    await (orch.drain() if drain else orch.abandon())  # abandon: paused groups a resumed run would start again
    await inference.close()
    trainer.close()
    metrics.plot(out / "metrics.png")
    return metrics.rows()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config", nargs="?", help="TOML config (defaults apply when omitted)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in run.output_dir")
    p.add_argument("--overwrite", action="store_true", help="clear a used run.output_dir and start over")
    p.add_argument("--no-overlap", action="store_true", help="train inline (deterministic, no rollout overlap)")
    args, overrides = p.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        check_machine(cfg)
        if int(os.environ.get("RANK", 0)) > 0:  # a torchrun follower: trains what rank 0 announces
            trainer, _, _ = build_trainer(cfg, resume=args.resume)
            follow(trainer)
        else:  # rank 0 claims the run directory for every rank (torchrun ends them all if it refuses)
            asyncio.run(run(cfg, resume=args.resume, overwrite=args.overwrite, overlap=not args.no_overlap))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # every rank tears the group down together (tests/dp_train_step.py says why)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

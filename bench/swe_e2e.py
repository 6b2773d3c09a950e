"""SWE end to end (issue 24): the harness's async GRPO on the offline SWE task set for a few steps -- real task
repositories checked out into the bubblewrap jail, tool calls, grading at submit (or of the diff left at the turn
cap), training, weight sync -- and a report of the rewards and where each step's time went.

The time split per step: ``rollout_s`` / ``train_s`` / ``sync_s`` are wall seconds of the step's phases (rollouts
of the next step overlap training); inside the rollouts, ``episode_generate_s`` / ``episode_tool_s`` /
``episode_grade_s`` are the episodes' own seconds waiting on the engine, on tools and on grading, summed over
episodes (they run concurrently: episode-seconds, shares of the rollout work, not wall).

    python -m bench.swe_e2e --config configs/swe/gpu_small.toml --data data/swe --out-dir runs/swe-e2e \\
        [--json PATH] [--section.key value ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

from harness import checkpoint
from harness.config import ConfigError, check_machine, load_config

SPLIT = ("episode_generate_s", "episode_tool_s", "episode_grade_s")


def report(rows: list[dict], cfg, command: str, seconds: float) -> dict:
    """Per step: reward, win rate, turns, compactions, re-prefilled tokens and the time split; totals."""
    keys = ("step", "reward", "win_rate", "turns", "compactions", "tokens_generated", "tokens_reprefilled",
            "peak_live_kv_tokens", "rollout_s", "train_s", "sync_s", *SPLIT)
    steps = [{k: r.get(k) for k in keys} for r in rows]
    split = {k: sum(r.get(k, 0.0) for r in rows) for k in SPLIT}
    total = sum(split.values())
    return {
        "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "wall_s": round(seconds, 1),
        "engine": cfg.inference.engine, "device": cfg.inference.device, "kv_dtype": cfg.inference.kv_dtype,
        "compaction": cfg.compaction.model_dump(mode="json"), "environment": cfg.environment.model_dump(mode="json"),
        "steps": steps,
        "mean_reward": sum(s["reward"] for s in steps) / len(steps) if steps else None,
        "tokens_reprefilled": sum(s["tokens_reprefilled"] for s in steps),
        "episode_time_share": {k: v / total for k, v in split.items()} if total else None,
        "wall_split_s": {k: round(sum(r.get(k, 0.0) for r in rows), 2) for k in ("rollout_s", "train_s", "sync_s")},
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="other --section.key value arguments override the config")
    p.add_argument("--config", required=True)
    p.add_argument("--data", type=Path, required=True, help="the task set: instances.jsonl and repos/ (make swe-data)")
    p.add_argument("--out-dir", type=Path, required=True, help="the run's directory (metrics, checkpoints)")
    p.add_argument("--json", type=Path, default=None, help="the report (default OUT_DIR/swe_e2e.json)")
    args, overrides = p.parse_known_args(argv)
    if not (args.data / "instances.jsonl").exists() or not (args.data / "repos").is_dir():
        print(f"error: --data {args.data}: no instances.jsonl and repos/ there (make swe-data, or "
              f"bash bench/device/swe_bundle.sh)", file=sys.stderr)
        return 2
    data = args.data.resolve()
    options = f'{{instances = "{data / "instances.jsonl"}", workspaces = "{data / "repos"}"}}'
    try:
        cfg = load_config(args.config, ["--environment.options", options, "--run.output_dir", str(args.out_dir),
                                        *overrides])
        check_machine(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from harness.run import run

    command = shlex.join(["python", "-m", "bench.swe_e2e", *argv])
    t0 = time.perf_counter()
    rows = asyncio.run(run(cfg, overwrite=True))
    out = report(rows, cfg, command, time.perf_counter() - t0)
    path = args.json or args.out_dir / "swe_e2e.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    checkpoint.atomic_write_bytes(path, json.dumps(out, indent=1).encode())
    for s in out["steps"]:
        print(f"step {s['step']}: reward {s['reward']:.3f}, rollout {s['rollout_s']:.1f}s, train {s['train_s']:.1f}s; "
              + ", ".join(f"{k} {s[k]:.1f}" for k in SPLIT), flush=True)
    print(f"report {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

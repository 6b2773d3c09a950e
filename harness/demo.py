"""``make demo``: the main job end to end at CPU scale.

1. build a small Qwen3-shaped model with the byte tokenizer;
2. generate easy TextWorld games (train and held-out eval seeds are disjoint);
3. evaluate it on the held-out games (the engine, KV-streams Sliding Window, ``kv4rl`` KV);
4. SFT warm-start on expert episodes rendered under that compaction (``harness.sft``);
5. evaluate again;
6. async GRPO from the SFT checkpoint through the harness (``harness.run.run``);
7. evaluate again, then print the table (win rate and reward per stage with episode
   counts, tokens re-prefilled, peak KV tokens and bytes: kv4rl vs BF16 vs full context)
   and write ``eval.jsonl``, ``summary.json`` and ``demo.png`` into the run directory
   (SFT and RL keep their own ``metrics.jsonl`` / ``metrics.png``).

``python -m harness.demo [CONFIG.toml] [--section.key value ...]``; the default config is
``configs/demo_textworld.toml``: the harness's sections plus ``[sft]`` and ``[evaluation]``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

# Idle OpenMP workers sleep instead of spinning. The demo shares two cores between the engine,
# the trainer (a worker thread during RL), TextWorld and the game generators; spinning workers
# of one starved the others (SFT steps went from ~1.5 s to 30-50 s). Read when torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from pydantic import BaseModel, ConfigDict

from envs.registry import make_taskset
from kvstreams_sglang.streams import FullPrecisionPool, KV4Pool

from . import checkpoint
from .config import Config, ConfigError, check_machine, load_config
from .evaluate import EvalResult, evaluate, make_engine
from .metrics import MetricsLog
from .run import prepare_model, resolve_device, run
from .sft import SFTConfig, warm_start

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo_textworld.toml"
STAGES = ("before SFT", "after SFT", "after RL")


class DemoConfig(Config):
    sft: SFTConfig = SFTConfig()


def load_demo_config(path: str | Path | None = None, overrides: list[str] | None = None) -> DemoConfig:
    return load_config(path or DEFAULT_CONFIG, overrides, schema=DemoConfig)


class KVBytes(BaseModel):
    """Bytes of ``tokens`` live KV tokens of one stream in each format."""

    model_config = ConfigDict(frozen=True)

    tokens: int
    kv4rl: int  # INT4 codes + fp16 scale/offset for every token, INT8 copies of sink + recent positions
    bf16: int

    @classmethod
    def of(cls, tokens: int, *, num_layers: int, num_kv_heads: int, head_dim: int, sink: int,
           recent: int) -> KVBytes:
        shape = dict(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim)
        kv4 = tokens * KV4Pool.bytes_per_token(**shape) + min(tokens, sink + recent) * KV4Pool.side_bytes_per_token(
            **shape)
        return cls(tokens=tokens, kv4rl=kv4, bf16=tokens * FullPrecisionPool.bytes_per_token(
            **shape, dtype=torch.bfloat16))


def model_shape(model_path: str) -> dict:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    return dict(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)


async def run_demo(cfg: DemoConfig) -> dict:
    """The whole job; returns the summary written to ``summary.json``."""
    from rich.console import Console
    from transformers import AutoTokenizer

    from envs.rollout.chat import ChatRenderer

    console = Console()
    timings: dict[str, float] = {}
    t_start = clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        timings[name] = round(now - clock, 1)
        clock = now

    out = Path(cfg.run.output_dir)
    if out.exists():
        shutil.rmtree(out)  # a fresh run: the harness appends to metrics.jsonl and resumes from checkpoints
    out.mkdir(parents=True)
    (out / "config.json").write_text(cfg.model_dump_json(indent=1))
    torch.manual_seed(cfg.run.seed)
    device = resolve_device(cfg.inference.device)

    console.rule("[bold]1. model and games")
    base_path = prepare_model(cfg, out)
    taskset = make_taskset(cfg.environment.name, cfg.environment.options)
    train_tasks = taskset.tasks(cfg.environment.train_split)
    eval_tasks = taskset.tasks(cfg.environment.eval_split)[:cfg.environment.num_eval]
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(base_path), taskset.make_env().system_prompt)
    console.print(f"model {base_path}: {model_shape(base_path)}; {len(train_tasks)} train games, "
                  f"{len(eval_tasks)} held-out eval games")
    lap("model_and_games")

    results: dict[str, EvalResult] = {}
    eval_log = MetricsLog(out / "eval.jsonl")

    async def held_out(stage: str, model_path: str, weights: dict | None = None) -> None:
        engine = make_engine(cfg, model_path, device)
        if weights is not None:
            engine.update_weights(weights)
        result, _ = await evaluate(stage, engine, taskset, eval_tasks, renderer, cfg,
                                   temperature=cfg.evaluation.temperature, seed=cfg.run.seed)
        results[stage] = result
        eval_log.log({"step": len(results) - 1, **result.as_dict()})
        console.print(f"{stage}: won {result.wins}/{result.episodes} held-out games, mean reward "
                      f"{result.mean_reward:.3f}")

    console.rule("[bold]2. held-out evaluation before SFT")
    await held_out(STAGES[0], base_path)
    lap("eval_before_sft")

    console.rule("[bold]3. SFT on expert episodes (compacted as in RL)")
    sft = await warm_start(cfg, cfg.sft, base_path, taskset, renderer, device, out / "sft", console=console)
    sft_path = sft.model_path
    lap("sft")

    console.rule("[bold]4. held-out evaluation after SFT")
    await held_out(STAGES[1], sft_path)
    lap("eval_after_sft")

    console.rule("[bold]5. async GRPO (KV-streams, kv4rl) from the SFT checkpoint")
    rl_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": sft_path}),
                                    "run": cfg.run.model_copy(update={"output_dir": str(out / "rl")})})
    rl_rows = await run(Config.model_validate(rl_cfg.model_dump(exclude={"sft"})),
                        resume=False, overlap=True)
    lap("rl")

    console.rule("[bold]6. held-out evaluation after RL")
    state = checkpoint.load_latest(out / "rl" / "checkpoints")
    await held_out(STAGES[2], sft_path, weights=state["trainer"]["model"])
    lap("eval_after_rl")

    shape = model_shape(base_path)
    i = cfg.inference
    # over the held-out episodes of every stage, from their records (RL logs its own peak per step)
    peak = max(r.peak_kv_tokens for r in results.values())
    full = max(r.full_context_tokens for r in results.values())
    kv = {name: KVBytes.of(tokens, **shape, sink=i.sink, recent=i.recent).model_dump()
          for name, tokens in (("peak", peak), ("full_context", full))}
    timings["total"] = round(time.perf_counter() - t_start, 1)
    summary = {
        "stages": {k: v.as_dict() for k, v in results.items()},
        "expert_nll": {"before_sft": sft.nll_before, "after_sft": sft.nll_after},
        "tokens_reprefilled": {"rl": sum(r["tokens_reprefilled"] for r in rl_rows),
                               "eval": sum(r.tokens_reprefilled for r in results.values())},
        "kv": kv, "rl_peak_live_kv_tokens": max(r["peak_live_kv_tokens"] for r in rl_rows),
        "rl_steps": len(rl_rows), "sft_steps": sft.steps, "timings_s": timings,
        "compaction": cfg.compaction.model_dump(), "kv_dtype": i.kv_dtype, "model": shape,
        "eval_temperature": cfg.evaluation.temperature,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(out / "demo.png", results, MetricsLog(out / "sft" / "metrics.jsonl").rows(), rl_rows)
    console.print(report(summary))
    console.print(f"run directory {out}: eval.jsonl, summary.json, demo.png, sft/metrics.jsonl, rl/metrics.jsonl "
                  f"({timings['total']:.0f}s)")
    return summary


def report(summary: dict):
    """The demo's table (a rich renderable)."""
    from rich.console import Group
    from rich.table import Table

    t = summary["eval_temperature"]
    stages = Table(title=f"Held-out games ({'greedy' if t == 0 else f'temperature {t}'})")
    for col in ("stage", "episodes", "wins", "win rate", "mean reward", "mean turns"):
        stages.add_column(col, justify="right")
    for name, r in summary["stages"].items():
        stages.add_row(name, str(r["episodes"]), str(r["wins"]), f"{r['win_rate']:.1%}", f"{r['mean_reward']:.3f}",
                       f"{r['mean_turns']:.2f}")
    kv, rp = summary["kv"], summary["tokens_reprefilled"]
    memory = Table(title=f"KV per episode stream ({summary['compaction']['strategy']}, "
                         f"{summary['compaction']['execution']}, {summary['kv_dtype']})")
    for col in ("", "tokens", "kv4rl bytes", "BF16 bytes", "BF16 / kv4rl"):
        memory.add_column(col, justify="right")
    for name, label in (("peak", "peak live KV (compacted)"), ("full_context", "full context (no compaction)")):
        k = kv[name]
        memory.add_row(label, str(k["tokens"]), f"{k['kv4rl']:,}", f"{k['bf16']:,}",
                       f"{k['bf16'] / max(1, k['kv4rl']):.2f}x")
    memory.add_row("full-context BF16 / compacted kv4rl", "", "", "",
                   f"{kv['full_context']['bf16'] / max(1, kv['peak']['kv4rl']):.2f}x")
    memory.add_row("tokens re-prefilled (RL + eval)", str(rp["rl"] + rp["eval"]), "", "", "")
    return Group(stages, memory)


def plot(path: Path, results: dict[str, EvalResult], sft_rows: list[dict], rl_rows: list[dict]) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    names = list(results)
    axes[0].bar(names, [results[n].win_rate for n in names], color=["#999", "#69c", "#c63"][:len(names)])
    for x, n in enumerate(names):
        axes[0].text(x, results[n].win_rate, f"{results[n].wins}/{results[n].episodes}", ha="center", va="bottom")
    axes[0].set_ylabel("held-out win rate")
    axes[0].set_ylim(0, 1)
    axes[1].plot([r["step"] for r in sft_rows], [r["nll"] for r in sft_rows], marker=".")
    axes[1].set_xlabel("SFT step")
    axes[1].set_ylabel("expert command nll (nats/token)")
    steps, wins = [r["step"] for r in rl_rows], [r["win_rate"] for r in rl_rows]
    axes[2].plot(steps, wins, marker=".", alpha=0.5, label="train win rate")
    window = 10  # one step is 4 groups: its win rate is noisy
    if len(wins) >= window:
        mean = [sum(wins[i - window + 1:i + 1]) / window for i in range(window - 1, len(wins))]
        axes[2].plot(steps[window - 1:], mean, color="k", label=f"train win rate ({window}-step mean)")
    axes[2].plot([r["step"] for r in rl_rows], [r["reward"] for r in rl_rows], marker=".", label="train reward")
    axes[2].set_xlabel("RL step")
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    # an optional config first, then --section.key value overrides (argparse would take an
    # override's value for the positional)
    path, overrides = (argv[0], argv[1:]) if argv and not argv[0].startswith("--") else (None, argv)
    try:
        cfg = load_demo_config(path, overrides)
        check_machine(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    asyncio.run(run_demo(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())

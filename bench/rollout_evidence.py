"""Issue 11's GPU evidence, items 1-3, in one run: rollout throughput under a fixed KV budget
(``bench.rollout_throughput``), KV concentration of continuous refill vs synchronous waves
(``bench.kv_concentration``) and sampler fidelity D_sampler (``bench.sampler_fidelity``).

Items 1 and 2 run a Qwen3-4B-shaped model with random weights (``kvstreams_sglang.checkpoints``, loaded once
and shared by every engine: ``Engine(model=...)``) on the built-in engine, replaying TextWorld-like episodes
through the real agent loop (``bench.replay``) whose turn lengths come from real games
(``bench/data/textworld_turns.json``, ``bench.textworld_lengths``);
item 3 runs ``--model-path`` (default: a tiny random model). Writes one JSON (``--out``) and a
PNG per item next to it, and prints one results table.

GPU (one H200, ~5 minutes with the defaults; the demo-trained model: SFT weights + the RL checkpoint)::

    python -m bench.rollout_evidence --model-path runs/demo/textworld/sft/model \
        --checkpoint runs/demo/textworld/rl/checkpoints

Before the timed runs, a *precompile pass* replays the same schedule on a 1-layer model with Qwen3-4B's
attention geometry: the decode kernels are specialised on their split count, which follows the batch
size and the context length, and every specialisation compiles on first use -- inside a measurement
otherwise. ``--dry-run`` replays items 1-2 on the CPU (bf16 engines sized like the GPU ones) and
prints the steps of every configuration and an H200 time estimate.

CPU, tiny model and tiny episodes (seconds; the test suite runs it)::

    python -m bench.rollout_evidence --quick --out /tmp/evidence.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).parent / "results" / "rollout_evidence_h200.json"
# 152k embedding rows (Qwen3's): ids past the byte tokenizer are never text, and a random model samples the
# end-of-turn token about once in 150k tokens, so replayed messages keep their recorded lengths
TINY = dict(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=128, vocab_rows=151936)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, tiny episodes, all items")
    p.add_argument("--dry-run", action="store_true",
                   help="items 1-2 on the CPU with a 1-layer model and bf16 engines sized like the Qwen3-4B ones:\n"
                        "the exact GPU schedule (steps, batches, admissions) and an H200 time estimate")
    p.add_argument("--items", default="1,2,3", help="which items to run (comma-separated)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"results JSON (default $OUT/{DEFAULT_OUT.name} if $OUT is set, else {DEFAULT_OUT};\n"
                        "PNGs next to it; written after every item)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu (--quick: cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads) when on the CPU")
    g = p.add_argument_group("episodes (items 1 and 2)")
    g.add_argument("--data", type=Path, default=None, help="turn-length data (default bench/data/textworld_turns.json)")
    g.add_argument("--policies", default="expert,detour,random", help="which recorded policies' episodes to draw")
    g.add_argument("--length-scale", type=float, default=None,
                   help="scale the recorded texts, whose token counts are byte-tokenizer counts (default 0.3: roughly\n"
                        "what Qwen3's BPE makes of the same English text; 1 = bytes; --quick: 0.08); the chat\n"
                        "template's tokens around each piece are kept")
    g.add_argument("--max-turns", type=int, default=None, help="cut episodes at this many turns")
    g.add_argument("--no-precompile", dest="precompile", action="store_false",
                   help="skip the pass that compiles every Triton specialisation before the timed runs (GPU)")
    g.add_argument("--engine-model-path", default=None,
                   help="a checkpoint for items 1-2 instead of the random Qwen3-4B-shaped model")
    g = p.add_argument_group("item 1: rollout throughput")
    g.add_argument("--episodes", type=int, default=32)
    g.add_argument("--budget-gib", type=float, default=None,
                   help="KV memory budget per engine in GiB (default 1.25; --quick: three full-context episodes)")
    g.add_argument("--max-batch", type=int, default=64, help="most concurrent episodes (engine max_streams cap)")
    g.add_argument("--window", type=int, default=4,
                   help="Sliding Window: evict the oldest turn when this many completed turns are live")
    g.add_argument("--kv-dtypes", default="bf16,kv4rl")
    g.add_argument("--executions", default="kv_streams,reprefill,full_context")
    g = p.add_argument_group("item 2: KV concentration")
    g.add_argument("--conc-episodes", type=int, default=48)
    g.add_argument("--conc-batch", type=int, default=24)
    g.add_argument("--conc-kv", default="bf16")
    g.add_argument("--conc-strategy", default="full_context", choices=["full_context", "sliding_window"])
    g = p.add_argument_group("item 3: sampler fidelity")
    g.add_argument("--model-path", default=None, help="model for D_sampler (default: a tiny random model)")
    g.add_argument("--checkpoint", default=None, help="harness checkpoint dir whose trainer weights to load on top")
    g.add_argument("--fid-episodes", type=int, default=16, help="sampled episodes (recorded TextWorld texts)")
    g.add_argument("--fid-max-new-tokens", type=int, default=32, help="cap per sampled command (the demo: 32)")
    g.add_argument("--check-episodes", type=int, default=2, help="streams for the engine vs fake-quant check")
    a = p.parse_args(argv)
    a.items = {int(x) for x in a.items.split(",") if x}
    if a.quick:
        a.device = a.device or "cpu"
        a.length_scale = 0.08 if a.length_scale is None else a.length_scale
        a.max_turns = a.max_turns or 6
        a.episodes = min(a.episodes, 10)
        a.max_batch = min(a.max_batch, 8)
        a.window = min(a.window, 3)
        a.conc_episodes = min(a.conc_episodes, 12)
        a.conc_batch = min(a.conc_batch, 4)
        a.fid_episodes = min(a.fid_episodes, 3)
        a.fid_max_new_tokens = min(a.fid_max_new_tokens, 6)
        a.check_episodes = min(a.check_episodes, 2)
    if a.dry_run:
        a.device = "cpu"
        a.items -= {3}
    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.length_scale is None:
        a.length_scale = 0.3
    if a.budget_gib is None and not a.quick:
        a.budget_gib = 1.25
    if a.out is None:
        if a.dry_run:
            a.out = Path(tempfile.gettempdir()) / "rollout_evidence_dryrun.json"
        else:  # on the device tool, results come back from $OUT
            a.out = Path(os.environ["OUT"]) / DEFAULT_OUT.name if os.environ.get("OUT") else DEFAULT_OUT
    return a


def results_table(result: dict):
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table

    parts = []
    if "throughput" in result:
        from .rollout_common import fmt_bytes

        tp = result["throughput"]
        t = Table(title=f"1. Rollout throughput, KV budget {fmt_bytes(tp['budget_gib'] * 2**30)} per engine, "
                        f"{tp['episodes']} episodes (length scale {tp['episode_source']['length_scale']})"
                        + (" -- DRY RUN: bf16 engines on the CPU, only steps and est H200 s are meaningful"
                           if result.get("dry_run") else ""), title_justify="left")
        for col in ("config", "tok/s", "GPU-s/100 ep", "re-prefilled", "prefilled", "peak KV tok", "peak KV",
                    "pool tok", "streams", "mean conc.", "decode batch", "steps", "splits", "wall s", "est H200 s"):
            t.add_column(col, justify="right")
        for r in tp["rows"]:
            t.add_row(r["config"], f"{r['tokens_per_s']:.0f}", f"{r['gpu_s_per_100_episodes']:.1f}",
                      f"{r['tokens_reprefilled']:,}", f"{r['tokens_prefilled']:,}", f"{r['peak_kv_tokens']:,}",
                      fmt_bytes(r["peak_kv_bytes"]), f"{r['pool_tokens']:,}", str(r["max_streams"]),
                      f"{r['mean_concurrency']:.1f}", f"{r['mean_decode_batch']:.1f}", str(r["steps"]),
                      str(len(r["decode_split_variants"])), f"{r['wall_s']:.1f}", f"{r['est_h200_s']:.0f}")
        parts.append(t)
        if result["throughput"]["ratios"]:
            rt = Table(title="   throughput ratios", title_justify="left")
            rt.add_column("ratio")
            rt.add_column("x", justify="right")
            for k, v in result["throughput"]["ratios"].items():
                rt.add_row(k, f"{v:.2f}")
            parts.append(rt)
    if "concentration" in result:
        c = result["concentration"]
        t = Table(title=f"2. KV concentration, B={c['max_batch']}, {c['episodes']} episodes ({c['strategy']}, "
                        f"{c['kv_dtype']})", title_justify="left")
        for col in ("metric", "refill", "waves", "waves/refill", "concentration", "paper"):
            t.add_column(col, justify="right")
        for (key, v), paper in zip(c["ratios"].items(), c["paper_ratios"], strict=True):
            t.add_row(v["label"], f"{c['refill'][key]:.2f}", f"{c['waves'][key]:.2f}", f"{v['waves_over_refill']:.2f}",
                      f"{v['concentration']:.2f}x", f"{paper}x")
        th = c["theory"]
        t.add_row("steps / wall s / est H200 s", f"{c['refill']['steps']} / {c['refill']['wall_s']:.1f} / "
                  f"{c['refill']['est_h200_s']:.0f}", f"{c['waves']['steps']} / {c['waves']['wall_s']:.1f} / "
                  f"{c['waves']['est_h200_s']:.0f}", "", "", "")
        t.add_row("C_KV measured (resident KV refill/waves)", "", "", "", f"{c['c_kv_measured']:.2f}x", "")
        t.add_row(escape("E[max L]/E[L], L = generated tokens"), "", "", "", f"{th['e_max_over_e_l_generated']:.2f}x",
                  "")
        t.add_row(escape("E[max L]/E[L], L = episode tokens"), "", "", "",
                  f"{th['e_max_over_e_l_episode_tokens']:.2f}x", "")
        t.add_row("idealised waves/refill calls, these episodes", "", "", "",
                  f"{th['scheduled_call_ratio_these_episodes']:.2f}x", "")
        parts.append(t)
    if "fidelity" in result:
        f = result["fidelity"]
        t = Table(title=f"3. Sampler fidelity D_sampler ({f['configs']['kv8']['prefixes']} prefixes, "
                        f"{f['episodes']} episodes, {f['model_path']})", title_justify="left")
        for col in ("config", "sink", "recent", "mean KL", "+- sem", "median KL", "vs 16+128"):
            t.add_column(col, justify="right")
        ref = f["configs"]["kv4_sink16_recent128"]["mean_kl"]
        for name, r in f["configs"].items():
            t.add_row(name, str(r["sink"]), str(r["recent"]), f"{r['mean_kl']:.3e}", f"{r['sem_kl']:.1e}",
                      f"{r['median_kl']:.3e}", f"{r['mean_kl'] / ref:.2f}x" if ref else "")
        ec = f["engine_check"]
        t.add_row("unprotected / protected", "", "", f"{f['ratio_unprotected_over_protected']:.2f}x", "", "",
                  "paper 7.0x")
        for kv in ("bf16", "kv4rl"):
            e = ec[kv]
            t.add_row(f"engine {kv} vs fake-quant |dlogprob| max / mean", "", "", f"{e['max_abs_diff']:.1e}",
                      f"{e['mean_abs_diff']:.1e}", f"(other: {e['mean_abs_diff_vs_other_storage']:.1e})",
                      f"{e['tokens']} tok")
        parts.append(t)
    return Group(*parts)


def qwen3_4b_kv() -> dict:
    from kvstreams_sglang.checkpoints import QWEN3_4B

    return dict(num_layers=QWEN3_4B.num_layers, num_kv_heads=QWEN3_4B.num_kv_heads, head_dim=QWEN3_4B.head_dim,
                dtype=torch.bfloat16)


def replay_renderer(model_path: str):
    from transformers import AutoTokenizer

    from envs.rollout.chat import ChatRenderer

    from .replay import SYSTEM_PROMPT

    return ChatRenderer(AutoTokenizer.from_pretrained(model_path), SYSTEM_PROMPT)


def rollout_items(a, model, renderer, *, size_for=None, engine_kv=None, progress=None, log=print) -> dict:
    """Items 1 and 2 on ``model`` (episodes drawn from ``a``'s settings, rendered by ``renderer``); see
    ``rollout_throughput.run`` for ``size_for`` / ``engine_kv``."""
    from . import kv_concentration, rollout_throughput
    from .replay import DATA, Template, length_stats, load_episode_pool, sample_episodes
    from .rollout_common import kv_bytes

    pool = load_episode_pool(a.data or DATA, tuple(a.policies.split(",")))
    template = Template.of(renderer)
    ep_desc = dict(data=str(a.data or DATA), policies=a.policies, length_scale=a.length_scale,
                   max_turns=a.max_turns, seed=a.seed)
    out, timings = {}, {}
    if 1 in a.items:
        t0 = time.perf_counter()
        eps = sample_episodes(pool, a.episodes, a.seed, length_scale=a.length_scale, max_turns=a.max_turns,
                              template=template)
        if a.budget_gib is None:  # --quick: about three full-context episodes' KV in bf16
            shape = size_for or rollout_throughput.model_shape(model)
            per_token = kv_bytes("bf16", shape["num_layers"], shape["num_kv_heads"], shape["head_dim"],
                                 dtype=shape["dtype"])["per_token"]
            a.budget_gib = 3 * statistics.fmean(e.total for e in eps) * per_token / 2**30
        res = rollout_throughput.run(model, a.device, eps, renderer, budget_bytes=int(a.budget_gib * 2**30),
                                     max_batch=a.max_batch, window=a.window, kv_dtypes=tuple(a.kv_dtypes.split(",")),
                                     executions=tuple(a.executions.split(",")), seed=a.seed,
                                     size_for=size_for, engine_kv=engine_kv, progress=progress, log=log)
        out["throughput"] = dict(
            budget_gib=a.budget_gib, episodes=len(eps), max_batch=a.max_batch, window=a.window, episode_source=ep_desc,
            episode_stats=dict(turns=length_stats([len(e.turns) for e in eps]),
                               generated=length_stats([e.generated for e in eps]),
                               total=length_stats([e.total for e in eps])), **res)
        timings["throughput"] = time.perf_counter() - t0
    if 2 in a.items:
        t0 = time.perf_counter()
        eps = sample_episodes(pool, a.conc_episodes, a.seed + 1, length_scale=a.length_scale, max_turns=a.max_turns,
                              template=template)
        pool_gen = [e.generated for e in sample_episodes(pool, len(pool) * 20, a.seed + 2, template=template,
                                                         length_scale=a.length_scale, max_turns=a.max_turns)]
        res = kv_concentration.run(model, a.device, eps, renderer, max_batch=a.conc_batch,
                                   kv_dtype=engine_kv or a.conc_kv, strategy=a.conc_strategy, window=a.window,
                                   seed=a.seed, pool_lengths=pool_gen, progress=progress, log=log)
        out["concentration"] = dict(episode_source=ep_desc, **res)
        timings["concentration"] = time.perf_counter() - t0
    out["timings_s"] = timings
    return out


def main(argv=None) -> dict:
    a = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if a.device == "cpu":
        torch.set_num_threads(a.threads)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvstreams_sglang.checkpoints import QWEN3_4B, build_tiny_model

    from . import kv_concentration, rollout_throughput, sampler_fidelity
    from .rollout_common import device_name, load_engine_model

    console = Console(width=None if sys.stdout.isatty() else 200)
    t_start = time.perf_counter()
    tmp = tempfile.TemporaryDirectory(prefix="rollout_evidence_")
    tiny_path = None

    def tiny() -> str:
        nonlocal tiny_path
        if tiny_path is None:
            tiny_path = str(build_tiny_model(Path(tmp.name) / "tiny", **TINY))
        return tiny_path

    a.out.parent.mkdir(parents=True, exist_ok=True)
    args = argv if argv is not None else sys.argv[1:]
    result = dict(command="python -m bench.rollout_evidence " + " ".join(shlex.quote(x) for x in args),
                  device=device_name(a.device), torch=torch.__version__, python=platform.python_version(),
                  quick=a.quick, dry_run=a.dry_run, timings_s={})

    def save() -> None:  # after every item: a run cut short still leaves what it measured
        a.out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    def plot(fn, data, name) -> None:
        try:
            fn(data, a.out.with_name(f"{a.out.stem}_{name}.png"))
        except Exception as e:  # a missing plotting library must not lose the numbers
            console.print(f"[yellow]plot {name} failed: {e!r}")

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        if a.items & {1, 2}:
            t0 = time.perf_counter()
            size_for = engine_kv = None
            if a.dry_run:
                path = str(build_tiny_model(Path(tmp.name) / "tiny1", **dict(TINY, num_layers=1)))
                model_desc = "dry run: 1-layer tiny model, bf16 engines sized for the Qwen3-4B shape's KV bytes"
                size_for, engine_kv = qwen3_4b_kv(), "bf16"
            elif a.engine_model_path or a.quick:
                path = a.engine_model_path or tiny()
                model_desc = a.engine_model_path or f"tiny random Qwen3 {TINY}"
            else:
                if a.precompile:
                    # The same schedule on a 1-layer model with Qwen3-4B's attention geometry compiles every
                    # Triton specialisation the timed runs will meet (decode split counts vary with batch
                    # and context), so that no compile lands inside a measurement.
                    t1 = time.perf_counter()
                    small_shape = dataclasses.replace(QWEN3_4B, num_layers=1, hidden_size=256, intermediate_size=512)
                    small_path = str(build_tiny_model(Path(tmp.name) / "small", **small_shape.kwargs(),
                                                      dtype=torch.bfloat16, device=a.device, seed=a.seed))
                    small = load_engine_model(small_path, a.device)
                    rollout_items(a, small, replay_renderer(small_path), size_for=qwen3_4b_kv(), log=lambda *_: None)
                    del small
                    result["timings_s"]["precompile"] = time.perf_counter() - t1
                    console.print(f"precompile pass (1-layer model, same schedule): "
                                  f"{result['timings_s']['precompile']:.1f}s")
                path = str(build_tiny_model(Path(tmp.name) / "qwen3-4b", **QWEN3_4B.kwargs(), dtype=torch.bfloat16,
                                            device=a.device, seed=a.seed))
                model_desc = "Qwen3-4B shape (36 layers, hidden 2560, 32/8 heads, head_dim 128, MLP 9728), random"
            model = load_engine_model(path, a.device)
            result["engine_model"] = model_desc
            result["timings_s"]["model"] = time.perf_counter() - t0 - result["timings_s"].get("precompile", 0.0)
            console.print(f"engine model: {model_desc} on {result['device']} ({result['timings_s']['model']:.1f}s)")
            res = rollout_items(a, model, replay_renderer(path), size_for=size_for, engine_kv=engine_kv,
                                progress=progress, log=console.print)
            result["timings_s"].update(res.pop("timings_s"))
            result.update(res)
            save()
            if "throughput" in result:
                plot(rollout_throughput.plot, result["throughput"], "throughput")
            if "concentration" in result:
                plot(kv_concentration.plot, result["concentration"], "concentration")
            del model
        if 3 in a.items:
            t0 = time.perf_counter()
            res = sampler_fidelity.run(a.model_path or tiny(), a.device, episodes=a.fid_episodes,
                                       max_new_tokens=a.fid_max_new_tokens, seed=a.seed, checkpoint=a.checkpoint,
                                       check_episodes=a.check_episodes, progress=progress, log=console.print)
            if a.model_path is None:
                res["model_path"] = f"tiny random Qwen3 {TINY}"
            result["fidelity"] = res
            result["timings_s"]["fidelity"] = time.perf_counter() - t0
            save()
            plot(sampler_fidelity.plot, res, "fidelity")
    result["timings_s"]["total"] = time.perf_counter() - t_start
    save()
    console.print(results_table(result))
    console.print(f"wrote {a.out} (+ PNGs) in {result['timings_s']['total']:.0f}s: "
                  + ", ".join(f"{k} {v:.0f}s" for k, v in result["timings_s"].items()))
    tmp.cleanup()
    return result


if __name__ == "__main__":
    main()

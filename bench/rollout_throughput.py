"""Issue 11, evidence 1: rollout throughput under a fixed KV memory budget.

The same TextWorld-like episodes (turn lengths of real games, ``bench/data/textworld_turns.json``)
replayed on the built-in engine under six configurations, side by side:

==================  =====================================================================
execution           what happens when the Sliding Window drops the oldest turn
==================  =====================================================================
``kv_streams``      ``Engine.evict``: its slots are freed in place, nothing recomputed
``reprefill``       the stream is closed and re-opened on the kept tokens (all recomputed)
``full_context``    no compaction: the stream keeps every token
==================  =====================================================================

each with ``bf16`` and ``kv4rl`` KV. The pool of every engine is the largest that fits the same
byte budget (``rollout_common.size_pool``: kv4rl's INT8 side rows per stream are allocated up
front and counted). An episode is admitted when its peak KV fits next to the reservations of the
running ones (and a batch slot is free); finished episodes are replaced at once (continuous
refill). Reported per configuration: generated tokens/s, GPU-seconds per 100 episodes,
re-prefilled tokens, peak KV tokens and bytes, mean concurrency.
"""

from __future__ import annotations

import asyncio
import statistics

from .rollout_common import (
    EpisodeSpec,
    ReplayConfig,
    decode_split_variants,
    estimate_gpu_seconds,
    fmt_bytes,
    free_engine,
    kv_bytes,
    make_engine,
    replay,
    size_pool,
    warm_up,
)

CONFIGS = (("kv_streams", "sliding_window"), ("reprefill", "sliding_window"), ("full_context", "full_context"))
LABELS = {"kv_streams": "KV-streams SW", "reprefill": "re-prefill SW", "full_context": "full context"}


def model_shape(model) -> dict:
    c = model.config
    return dict(num_layers=c.num_hidden_layers, num_kv_heads=c.num_key_value_heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
                dtype=next(model.parameters()).dtype)


def run(model, device, episodes: list[EpisodeSpec], *, budget_bytes: int, max_batch: int = 64, window: int = 4,
        kv_dtypes=("bf16", "kv4rl"), executions=("kv_streams", "reprefill", "full_context"), sink: int = 16,
        recent: int = 128, seed: int = 0, vocab: int = 256, size_for: dict | None = None,
        engine_kv: str | None = None, progress=None, log=print) -> dict:
    """``size_for``: size the pools for this model shape's KV bytes (``num_layers, num_kv_heads,
    head_dim, dtype``) instead of ``model``'s, so that a small model replays the exact schedule --
    admissions, steps, batches, kernel specialisations -- of the large one (the schedule does not
    depend on the model). ``engine_kv``: run every engine with this KV storage instead (``bf16``
    for a cheap dry run on the CPU; the schedule does not depend on the storage either)."""
    shape = size_for or model_shape(model)
    rows = []
    for kv in kv_dtypes:
        b = kv_bytes(kv, shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], dtype=shape["dtype"],
                     sink=sink, recent=recent)
        for execution, strategy in (c for c in CONFIGS if c[0] in executions):
            peaks = [ep.peak_live(strategy, window) for ep in episodes]
            max_tokens, max_streams = size_pool(budget_bytes, b, max_batch, statistics.fmean(peaks))
            name = f"{LABELS[execution]} / {kv}"
            if max(peaks) > max_tokens:
                raise ValueError(f"{name}: the longest episode needs {max(peaks)} KV tokens but a budget of "
                                 f"{budget_bytes} bytes holds {max_tokens}: raise --budget-gib")
            eng = make_engine(model, engine_kv or kv, max_tokens=max_tokens, max_streams=max_streams,
                              max_context=max(peaks) + 64, device=device, sink=sink, recent=recent)
            assert size_for is not None or eng.pool.nbytes <= budget_bytes, (eng.pool.nbytes, budget_bytes)
            warm_up(eng, n=min(4, max_streams))
            s0 = dict(vars(eng.stats), tokens_reprefilled=eng.stats.tokens_reprefilled)
            task = progress.add_task(name, total=len(episodes)) if progress is not None else None
            cfg = ReplayConfig(strategy=strategy, execution="reprefill" if execution == "reprefill" else "kv_streams",
                               window=window, max_batch=max_streams, seed=seed)
            res = asyncio.run(replay(eng, episodes, cfg, max_tokens, vocab=vocab,
                                     on_done=(lambda t=task: progress.advance(t)) if task is not None else None))
            st = eng.stats
            steps = res.log.summary()
            peak_bytes = st.peak_slots * b["per_token"] + res.peak_open_streams * b["per_stream"]
            row = dict(
                config=name, execution=execution, strategy=strategy, kv_dtype=kv, window=window,
                budget_bytes=budget_bytes,
                pool_bytes=eng.pool.nbytes if size_for is None else max_tokens * b["per_token"] + max_streams * b[
                    "per_stream"] + b["fixed"], pool_tokens=max_tokens, max_streams=max_streams,
                bytes_per_token=b["per_token"], side_bytes_per_stream=b["per_stream"],
                episodes=res.episodes, wall_s=res.wall_s, generated_tokens=res.generated,
                tokens_per_s=res.generated / res.wall_s, gpu_s_per_100_episodes=100 * res.wall_s / res.episodes,
                tokens_reprefilled=res.reprefilled,
                engine_tokens_reprefilled=st.tokens_reprefilled - s0["tokens_reprefilled"],
                tokens_prefilled=st.tokens_prefilled - s0["tokens_prefilled"],
                tokens_decoded=st.tokens_decoded - s0["tokens_decoded"],
                tokens_evicted=res.evicted, peak_kv_tokens=st.peak_slots, peak_kv_bytes=peak_bytes,
                peak_open_streams=res.peak_open_streams, mean_episode_peak_tokens=statistics.fmean(peaks),
                max_episode_peak_tokens=max(peaks),
                mean_episode_peak_tokens_measured=statistics.fmean(res.episode_peaks),
                max_episode_peak_tokens_measured=max(res.episode_peaks),
                episodes_within_reservation=sum(m <= r for m, r in zip(res.episode_peaks, res.episode_reserved,
                                                                        strict=True)),
                mean_concurrency=steps["time_weighted_active_episodes"],
                decode_split_variants=decode_split_variants(res.log, kv, shape["num_kv_heads"], sink=sink,
                                                            recent=recent),
                est_h200_s=estimate_gpu_seconds(res.log, kv), **steps)
            rows.append(row)
            log(f"{name}: {row['tokens_per_s']:.0f} tok/s, {row['gpu_s_per_100_episodes']:.1f} GPU-s/100 ep, "
                f"re-prefilled {row['tokens_reprefilled']}, peak KV {row['peak_kv_tokens']} tok, "
                f"concurrency {row['mean_concurrency']:.1f}, {row['steps']} steps ({row['wall_s']:.1f}s)")
            free_engine(eng)
            del eng
    by = {r["config"]: r for r in rows}
    summary = {}
    for kv in kv_dtypes:
        ks, rp, fc = (by.get(f"{LABELS[e]} / {kv}") for e in ("kv_streams", "reprefill", "full_context"))
        if ks and rp:
            summary[f"{kv}: kv_streams / reprefill tokens/s"] = ks["tokens_per_s"] / rp["tokens_per_s"]
        if ks and fc:
            summary[f"{kv}: kv_streams / full_context tokens/s"] = ks["tokens_per_s"] / fc["tokens_per_s"]
    for e in executions:
        a, c = by.get(f"{LABELS[e]} / kv4rl"), by.get(f"{LABELS[e]} / bf16")
        if a and c:
            summary[f"{LABELS[e]}: kv4rl / bf16 tokens/s"] = a["tokens_per_s"] / c["tokens_per_s"]
    return dict(rows=rows, ratios=summary)


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["config"].replace(" / ", "\n") for r in rows]
    colors = ["tab:blue" if r["kv_dtype"] == "bf16" else "tab:orange" for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.4))
    for ax, key, title in zip(axes, ("tokens_per_s", "gpu_s_per_100_episodes", "mean_concurrency", "peak_kv_tokens"),
                              ("generated tokens/s", "GPU-seconds per 100 episodes", "mean concurrent episodes",
                               "peak KV tokens"), strict=True):
        ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
        ax.set_xticks(range(len(rows)), names, fontsize=7, rotation=35, ha="right")
        ax.set_title(title, fontsize=9)
    for i, r in enumerate(rows):
        if r["tokens_reprefilled"]:
            axes[0].annotate(f"re-prefilled\n{r['tokens_reprefilled']}", (i, r["tokens_per_s"]), ha="center",
                             va="bottom", fontsize=6)
    fig.suptitle(f"Rollout throughput, fixed KV budget {fmt_bytes(rows[0]['budget_bytes'])} "
                 f"({rows[0]['episodes']} episodes; blue bf16, orange kv4rl)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Issue 11, evidence 1: rollout throughput under a fixed KV memory budget.

The same TextWorld-like episodes (turn lengths of real games, ``bench/data/textworld_turns.json``)
replayed through the real agent loop (``bench.replay``: ``run_episode`` with the real Sliding Window) on the
built-in engine under six configurations, side by side:

==================  =====================================================================
execution           what happens when the Sliding Window drops the oldest turn
==================  =====================================================================
``kv_streams``      ``Engine.evict``: its slots are freed in place, nothing recomputed
``reprefill``       the loop closes the stream and re-opens the kept tokens (all recomputed)
``full_context``    no compaction: the stream keeps every token
==================  =====================================================================

each with ``bf16`` and ``kv4rl`` KV. The pool of every engine is the largest that fits the same
byte budget (``rollout_common.size_pool``: kv4rl's INT8 side rows per stream are allocated up
front and counted). An episode is admitted when its peak KV (``bench.replay.episode_peaks``: the same loop
without a model) fits next to the reservations of the running ones (and a batch slot is free); finished
episodes are replaced at once (continuous refill). Reported per configuration: generated tokens/s,
GPU-seconds per 100 episodes, re-prefilled tokens, peak KV tokens and bytes, mean concurrency.
"""

from __future__ import annotations

import statistics
import time

from envs.rollout.compaction import CompactionConfig

from .replay import EpisodeSpec, Gate, Replay, episode_config, episode_peaks
from .rollout_common import (
    decode_split_variants,
    estimate_gpu_seconds,
    fmt_bytes,
    free_engine,
    kv_bytes,
    make_engine,
    run_logged,
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


def compaction_for(execution: str, strategy: str, window: int) -> CompactionConfig:
    """Sliding Window evicting the oldest turn whenever ``window`` completed turns are live (stride 1)."""
    if strategy == "full_context":
        return CompactionConfig(strategy="full_context")
    return CompactionConfig(strategy=strategy, execution=execution, window_turns=window, stride=1)


def run(model, device, episodes: list[EpisodeSpec], renderer, *, budget_bytes: int, max_batch: int = 64,
        window: int = 4, kv_dtypes=("bf16", "kv4rl"), executions=("kv_streams", "reprefill", "full_context"),
        sink: int = 16, recent: int = 128, seed: int = 0, size_for: dict | None = None,
        engine_kv: str | None = None, progress=None, log=print) -> dict:
    """``size_for``: size the pools for this model shape's KV bytes (``num_layers, num_kv_heads,
    head_dim, dtype``) instead of ``model``'s, so that a small model replays the exact schedule --
    admissions, steps, batches, kernel specialisations -- of the large one (the schedule does not
    depend on the model). ``engine_kv``: run every engine with this KV storage instead (``bf16``
    for a cheap dry run on the CPU; the schedule does not depend on the storage either)."""
    shape = size_for or model_shape(model)
    config = episode_config()
    rows = []
    for kv in kv_dtypes:
        b = kv_bytes(kv, shape["num_layers"], shape["num_kv_heads"], shape["head_dim"], dtype=shape["dtype"],
                     sink=sink, recent=recent)
        for execution, strategy in (c for c in CONFIGS if c[0] in executions):
            replay = Replay(renderer, compaction_for(execution, strategy, window), config, seed=seed)
            peaks = episode_peaks(episodes, renderer, replay.compaction, config)
            max_tokens, max_streams = size_pool(budget_bytes, b, max_batch, statistics.fmean(peaks))
            name = f"{LABELS[execution]} / {kv}"
            if max(peaks) > max_tokens:
                raise ValueError(f"{name}: the longest episode needs {max(peaks)} KV tokens but a budget of "
                                 f"{budget_bytes} bytes holds {max_tokens}: raise --budget-gib")
            eng = make_engine(model, engine_kv or kv, max_tokens=max_tokens, max_streams=max_streams,
                              max_context=max(peaks) + 64, device=device, sink=sink, recent=recent)
            assert size_for is not None or eng.pool.nbytes <= budget_bytes, (eng.pool.nbytes, budget_bytes)
            warm_up(eng, replay, n=min(4, max_streams))
            s0 = dict(vars(eng.stats), tokens_reprefilled=eng.stats.tokens_reprefilled)
            task = progress.add_task(name, total=len(episodes)) if progress is not None else None
            gate = Gate(max_tokens, max_streams)
            t0 = time.perf_counter()
            done, steplog = run_logged(eng, episodes, replay, gate, peaks,
                                       on_done=(lambda t=task: progress.advance(t)) if task is not None else None)
            wall = time.perf_counter() - t0
            st = eng.stats
            steps = steplog.summary()
            eps = [d.episode for d in done]
            measured = [e.stats.peak_live_tokens for e in eps]
            generated = sum(e.stats.tokens_generated for e in eps)
            peak_bytes = st.peak_slots * b["per_token"] + gate.peak_active * b["per_stream"]
            row = dict(
                config=name, execution=execution, strategy=strategy, kv_dtype=kv, window=window,
                budget_bytes=budget_bytes,
                pool_bytes=eng.pool.nbytes if size_for is None else max_tokens * b["per_token"] + max_streams * b[
                    "per_stream"], pool_tokens=max_tokens, max_streams=max_streams,
                bytes_per_token=b["per_token"], side_bytes_per_stream=b["per_stream"],
                episodes=len(eps), wall_s=wall, generated_tokens=generated,
                tokens_per_s=generated / wall, gpu_s_per_100_episodes=100 * wall / len(eps),
                tokens_reprefilled=sum(e.stats.tokens_reprefilled for e in eps),
                engine_tokens_reprefilled=st.tokens_reprefilled - s0["tokens_reprefilled"],
                tokens_prefilled=st.tokens_prefilled - s0["tokens_prefilled"],
                tokens_decoded=st.tokens_decoded - s0["tokens_decoded"],
                tokens_evicted_in_place=st.evicted_tokens - s0["evicted_tokens"],
                compactions=sum(e.stats.compactions for e in eps), peak_kv_tokens=st.peak_slots,
                peak_kv_bytes=peak_bytes, peak_open_streams=gate.peak_active,
                mean_episode_peak_tokens=statistics.fmean(peaks), max_episode_peak_tokens=max(peaks),
                mean_episode_peak_tokens_measured=statistics.fmean(measured),
                max_episode_peak_tokens_measured=max(measured),
                episodes_within_reservation=sum(m <= d.reserved for m, d in zip(measured, done, strict=True)),
                # a message that sampled its end-of-turn token before its recorded length (rare: random weights)
                tokens_short_of_recorded=sum(s.generated for s in episodes) - generated,
                mean_concurrency=steps["time_weighted_active_episodes"],
                decode_split_variants=decode_split_variants(steplog, kv, shape["num_kv_heads"], sink=sink,
                                                            recent=recent),
                est_h200_s=estimate_gpu_seconds(steplog, kv), **steps)
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

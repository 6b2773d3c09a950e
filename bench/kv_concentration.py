"""Issue 11, evidence 2: KV concentration -- continuous refill vs synchronous waves.

The same episodes on one engine, the same maximum batch ``B``, memory never binding (the pool
holds ``B`` of the longest episodes): with *continuous refill* a finished episode is replaced at
once; with *synchronous waves* ``B`` episodes start together and the next wave starts only when
every episode of the previous one has finished, so each wave lasts as long as its longest
episode and the batch drains as its episodes end.

Measured for both (``rollout_common.StepLog``): mean active batch (streams per decode call),
number of decode calls, mean resident KV tokens per step and mean step latency, and the ratios
waves / refill. The idealised model: an episode of length ``L`` (here: generated tokens = the
decode steps it needs) in a wave of ``B`` waits for ``max L``, so waves need ``E[max_B L] / E[L]``
times the decode calls of refill at ``E[L] / E[max_B L]`` of its batch. We compare the measured
KV concentration ``C_KV`` = mean resident KV per step (refill / waves) and the measured
decode-call ratio with ``E[max_B L] / E[L]`` computed from the length distribution.
"""

from __future__ import annotations

import asyncio
import heapq

from .rollout_common import (
    EpisodeSpec,
    ReplayConfig,
    estimate_gpu_seconds,
    expected_max_over_mean,
    free_engine,
    make_engine,
    replay,
    warm_up,
)

METRICS = (("mean_decode_batch", "mean active batch (streams / decode call)", "refill"),
           ("decode_calls", "decode calls", "waves"),
           ("mean_resident_kv_tokens", "mean resident KV tokens / step", "refill"),
           ("mean_decode_step_ms", "mean decode step latency (ms)", "refill"))


def scheduled_calls(lengths: list[int], batch: int, *, waves: bool) -> int:
    """Decode calls of an idealised schedule (an episode of length ``L`` needs ``L`` calls, one
    call serves the whole batch): synchronous waves cost the longest episode of each wave,
    continuous refill is list scheduling in admission order (its makespan)."""
    if waves:
        return sum(max(lengths[i:i + batch]) for i in range(0, len(lengths), batch))
    finish = [0] * min(batch, len(lengths))
    for n in lengths:
        heapq.heapreplace(finish, finish[0] + n)
    return max(finish)


def run(model, device, episodes: list[EpisodeSpec], *, max_batch: int = 32, kv_dtype: str = "bf16",
        strategy: str = "full_context", window: int = 4, sink: int = 16, recent: int = 128, seed: int = 0,
        vocab: int = 256, pool_lengths: list[int] | None = None, progress=None, log=print) -> dict:
    peaks = sorted((ep.peak_live(strategy, window) for ep in episodes), reverse=True)
    max_tokens = sum(peaks[:max_batch]) + 64  # memory never binds: only the batch does
    eng = make_engine(model, kv_dtype, max_tokens=max_tokens, max_streams=max_batch, max_context=peaks[0] + 64,
                      device=device, sink=sink, recent=recent)
    warm_up(eng, n=min(4, max_batch))
    modes = {}
    for mode in ("refill", "waves"):
        task = progress.add_task(f"KV concentration: {mode}", total=len(episodes)) if progress is not None else None
        cfg = ReplayConfig(strategy=strategy, window=window, max_batch=max_batch, waves=mode == "waves", seed=seed)
        res = asyncio.run(replay(eng, episodes, cfg, max_tokens, vocab=vocab,
                                 on_done=(lambda t=task: progress.advance(t)) if task is not None else None))
        modes[mode] = dict(wall_s=res.wall_s, tokens_per_s=res.generated / res.wall_s,
                           est_h200_s=estimate_gpu_seconds(res.log, kv_dtype), **res.log.summary())
        log(f"KV concentration {mode}: {modes[mode]['decode_calls']} decode calls, batch "
            f"{modes[mode]['mean_decode_batch']:.1f}, resident KV {modes[mode]['mean_resident_kv_tokens']:.0f}, "
            f"{modes[mode]['mean_decode_step_ms']:.1f} ms/decode step, {res.wall_s:.1f}s")
    free_engine(eng)
    del eng
    r, w = modes["refill"], modes["waves"]
    ratios = {}
    for key, label, larger in METRICS:
        ratio = w[key] / r[key] if r[key] else float("nan")
        ratios[key] = dict(label=label, waves_over_refill=ratio,
                           concentration=(ratio if larger == "waves" else (1 / ratio if ratio else float("nan"))))
    gen = [ep.generated for ep in episodes]
    tot = [ep.total for ep in episodes]
    theory = dict(e_max_over_e_l_generated=expected_max_over_mean(gen, max_batch),
                  e_max_over_e_l_episode_tokens=expected_max_over_mean(tot, max_batch),
                  # the same idealisation on these very episodes, finite tails included
                  scheduled_call_ratio_these_episodes=(scheduled_calls(gen, max_batch, waves=True)
                                                       / scheduled_calls(gen, max_batch, waves=False)))
    if pool_lengths:
        theory["e_max_over_e_l_generated_pool"] = expected_max_over_mean(pool_lengths, max_batch)
    return dict(max_batch=max_batch, kv_dtype=kv_dtype, strategy=strategy, episodes=len(episodes),
                pool_tokens=max_tokens, refill=r, waves=w, ratios=ratios,
                c_kv_measured=r["mean_resident_kv_tokens"] / w["mean_resident_kv_tokens"],
                decode_call_ratio_measured=w["decode_calls"] / r["decode_calls"], theory=theory,
                paper_ratios=[8.27, 8.35, 7.82, 4.52])


def plot(result: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 5, figsize=(18, 3.6))
    for ax, (key, label, _) in zip(axes, METRICS, strict=False):
        vals = [result["refill"][key], result["waves"][key]]
        ax.bar([0, 1], vals, color=["tab:green", "tab:red"])
        ax.set_xticks([0, 1], ["refill", "waves"])
        ax.set_title(f"{label}\nwaves/refill {result['ratios'][key]['waves_over_refill']:.2f}", fontsize=8)
    ax = axes[-1]
    th = result["theory"]["e_max_over_e_l_generated"]
    ax.bar([0, 1, 2], [result["c_kv_measured"], result["decode_call_ratio_measured"], th],
           color=["tab:purple", "tab:gray", "tab:olive"])
    ax.set_xticks([0, 1, 2], ["C_KV\nmeasured", "decode calls\nwaves/refill", "E[max L]/E[L]"], fontsize=7)
    ax.set_title("concentration vs theory", fontsize=8)
    fig.suptitle(f"KV concentration: continuous refill vs synchronous waves (B={result['max_batch']}, "
                 f"{result['episodes']} episodes, {result['strategy']}, {result['kv_dtype']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""Issue 11, evidence 2: KV concentration -- continuous refill vs synchronous waves.

The same episodes on one engine, the same maximum batch ``B``, memory never binding (the pool
holds ``B`` of the longest episodes): with *continuous refill* a finished episode is replaced at
once; with *synchronous waves* ``B`` episodes start together and the next wave starts only when
every episode of the previous one has finished, so each wave lasts as long as its longest
episode and the batch drains as its episodes end.

Every episode runs the real agent loop (``bench.replay``). Measured for both (``rollout_common.StepLog``, from
``Engine.on_step``): mean active batch (streams per decode call),
number of decode calls, mean resident KV tokens per step and mean step latency, and the ratios
waves / refill. The idealised model: an episode of length ``L`` (here: generated tokens = the
decode steps it needs) in a wave of ``B`` waits for ``max L``, so waves need ``E[max_B L] / E[L]``
times the decode calls of refill at ``E[L] / E[max_B L]`` of its batch. We compare the measured
KV concentration ``C_KV`` = mean resident KV per step (refill / waves) and the measured
decode-call ratio with ``E[max_B L] / E[L]`` computed from the length distribution.
"""

from __future__ import annotations

import heapq
import time

from envs.rollout.compaction import CompactionConfig

from .replay import EpisodeSpec, Gate, Replay, episode_config, episode_peaks, expected_max_over_mean
from .rollout_common import estimate_gpu_seconds, free_engine, make_engine, run_logged, warm_up

METRICS = (("mean_decode_batch", "mean active batch (streams / decode call)", "refill"),
           ("decode_calls", "decode calls", "waves"),
           ("mean_resident_kv_tokens", "mean resident KV tokens / step", "refill"),
           ("mean_decode_step_ms", "mean decode step latency (ms)", "refill"))
# The KV4-RL paper's concentration for each METRICS entry, in order: active batch 8.27x, decode calls 8.35x,
# resident KV 7.82x, step latency 4.52x
PAPER_RATIOS = (8.27, 8.35, 7.82, 4.52)


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


def run(model, device, episodes: list[EpisodeSpec], renderer, *, max_batch: int = 32, kv_dtype: str = "bf16",
        strategy: str = "full_context", window: int = 4, sink: int = 16, recent: int = 128, seed: int = 0,
        pool_lengths: list[int] | None = None, progress=None, log=print) -> dict:
    compaction = (CompactionConfig(strategy="full_context") if strategy == "full_context"
                  else CompactionConfig(strategy=strategy, window_turns=window, stride=1))
    replay = Replay(renderer, compaction, episode_config(), seed=seed)
    reserved = episode_peaks(episodes, renderer, compaction, replay.config)
    peaks = sorted(reserved, reverse=True)
    max_tokens = sum(peaks[:max_batch]) + 64  # memory never binds: only the batch does
    eng = make_engine(model, kv_dtype, max_tokens=max_tokens, max_streams=max_batch, max_context=peaks[0] + 64,
                      device=device, sink=sink, recent=recent)
    warm_up(eng, replay, n=min(4, max_batch))
    modes = {}
    for mode in ("refill", "waves"):
        task = progress.add_task(f"KV concentration: {mode}", total=len(episodes)) if progress is not None else None
        gate = Gate(max_tokens, max_batch, waves=mode == "waves")
        t0 = time.perf_counter()
        done, steplog = run_logged(eng, episodes, replay, gate, reserved,
                                   on_done=(lambda t=task: progress.advance(t)) if task is not None else None)
        wall = time.perf_counter() - t0
        generated = sum(d.episode.stats.tokens_generated for d in done)
        modes[mode] = dict(wall_s=wall, tokens_per_s=generated / wall, waves=gate.num_waves,
                           est_h200_s=estimate_gpu_seconds(steplog, kv_dtype), **steplog.summary())
        log(f"KV concentration {mode}: {modes[mode]['decode_calls']} decode calls, batch "
            f"{modes[mode]['mean_decode_batch']:.1f}, resident KV {modes[mode]['mean_resident_kv_tokens']:.0f}, "
            f"{modes[mode]['mean_decode_step_ms']:.1f} ms/decode step, {wall:.1f}s")
    free_engine(eng)
    del eng
    return dict(max_batch=max_batch, kv_dtype=kv_dtype, strategy=strategy, episodes=len(episodes),
                pool_tokens=max_tokens, **concentration(modes["refill"], modes["waves"], episodes, max_batch,
                                                        pool_lengths))


def concentration(r: dict, w: dict, episodes: list[EpisodeSpec], max_batch: int,
                  pool_lengths: list[int] | None = None) -> dict:
    """Waves over refill for every ``METRICS`` entry, C_KV, and the idealised model on these episodes."""
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
    return dict(refill=r, waves=w, ratios=ratios,
                c_kv_measured=r["mean_resident_kv_tokens"] / w["mean_resident_kv_tokens"],
                decode_call_ratio_measured=w["decode_calls"] / r["decode_calls"], theory=theory,
                paper_ratios=list(PAPER_RATIOS))


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

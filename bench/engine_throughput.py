"""Built-in engine throughput on the GPU: bf16 vs kv4rl KV storage, same model, same streams.

A Qwen3-4B-shaped model with random weights (``kvstreams_sglang.checkpoints``: built on the GPU, saved once
as a local checkpoint, loaded through ``Engine(model_path)`` like any checkpoint). ``--streams``
streams each prefill ``--context`` tokens, then decode ``--new-tokens`` tokens together;
we report prefill and decode tokens/s and KV bytes for each storage, side by side.
Usage: ``python -m bench.engine_throughput [--streams 64 --context 4096 --new-tokens 64]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time

import torch


def build_random_checkpoint(path: str) -> str:
    from kvstreams_sglang.checkpoints import QWEN3_4B, build_tiny_model

    if not os.path.exists(os.path.join(path, "config.json")):
        build_tiny_model(path, **QWEN3_4B.kwargs(), dtype=torch.bfloat16, device="cuda")
        torch.cuda.empty_cache()
    return path


def run_one(model_path: str, kv_dtype: str, streams: int, context: int, new_tokens: int,
            profile: bool = False) -> dict:
    from kvstreams_sglang.engine import Engine, SamplingParams

    eng = Engine(model_path, kv_dtype=kv_dtype, device="cuda", kv_slots=streams * (context + new_tokens + 8),
                 max_streams=streams, max_context=context + new_tokens + 8, max_prefill_tokens=16384)
    g = torch.Generator().manual_seed(1)
    sids = [eng.open_stream(torch.randint(0, 150000, (context,), generator=g).tolist()) for _ in range(streams)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng.generate_many([(s, SamplingParams(max_new_tokens=1, seed=i)) for i, s in enumerate(sids)])
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    decode_steps0 = eng.stats.steps
    eng.generate_many([(s, SamplingParams(max_new_tokens=new_tokens, seed=100 + i)) for i, s in enumerate(sids)])
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    steps = eng.stats.steps - decode_steps0
    row = dict(kv_dtype=kv_dtype, streams=streams, context=context, new_tokens=new_tokens,
               prefill_s=t1 - t0, prefill_tok_s=streams * context / (t1 - t0),
               decode_s=t2 - t1, decode_tok_s=streams * new_tokens / (t2 - t1), decode_steps=steps,
               ms_per_decode_step=1000 * (t2 - t1) / steps, kv_pool_bytes=eng.pool.nbytes,
               tokens_reprefilled=eng.stats.tokens_reprefilled, peak_slots=eng.stats.peak_slots)
    if profile:  # where a decode step's time goes
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            eng.generate_many([(s, SamplingParams(max_new_tokens=3, seed=7)) for s in sids])
            torch.cuda.synchronize()
        print(f"--- {kv_dtype}: 3 decode steps ---")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    del eng
    gc.collect()
    torch.cuda.empty_cache()
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--model-path", default="/tmp/qwen3-4b-random")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    path = build_random_checkpoint(a.model_path)
    rows = []
    for kv in ("bf16", "kv4rl"):
        row = run_one(path, kv, a.streams, a.context, a.new_tokens, a.profile)
        print(json.dumps(row), flush=True)
        rows.append(row)
    speedup = rows[1]["decode_tok_s"] / rows[0]["decode_tok_s"]
    print(f"decode tokens/s: bf16 {rows[0]['decode_tok_s']:.0f}, kv4rl {rows[1]['decode_tok_s']:.0f} "
          f"(kv4rl/bf16 = {speedup:.2f}x); KV pool bytes bf16 {rows[0]['kv_pool_bytes'] / 1e9:.1f} GB, "
          f"kv4rl {rows[1]['kv_pool_bytes'] / 1e9:.1f} GB")
    out = a.out or os.path.join(os.environ.get("OUT", "bench/results"), "engine_throughput_h200.json")
    with open(out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, model="Qwen3-4B shape, random",
                       command=f"python -m bench.engine_throughput --streams {a.streams} --context {a.context} "
                               f"--new-tokens {a.new_tokens}", rows=rows, decode_speedup_kv4rl_vs_bf16=speedup),
                  f, indent=1)


if __name__ == "__main__":
    main()

"""KV4 decode attention on the GPU: time, achieved bandwidth and correctness per shape.

Page size 1 with shuffled slot indices, random data; bytes counted are those the
kernel must read (INT4 codes + meta for the INT4 region, INT8 codes + scale for the
144-position side region, slot indices, the query) and write (the output).
Usage: ``python -m bench.decode_attention [--quick] [--out bench/results/x.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch


def kv4_bytes(batch: int, length: int, hq: int, hkv: int, d: int, sink: int, recent: int) -> int:
    prot = min(length, sink + recent)
    per_head = (length - prot) * 2 * (d // 2 + 4) + prot * 2 * (d + 2)
    return batch * (hkv * per_head + length * 4 + hq * d * 2 * 2)


def bf16_bytes(batch: int, length: int, hq: int, hkv: int, d: int) -> int:
    return batch * (hkv * length * 2 * d * 2 + length * 4 + hq * d * 2 * 2)


def build_kv4_case(batch, length, hq, hkv, d, sink, recent, device, seed=0, **plan_kw):
    from kvstreams_sglang.kernels import kv4_store, plan_decode
    from kvstreams_sglang.kv4 import KV4LayerCache, side_slot, split_regions

    g = torch.Generator(device=device).manual_seed(seed)
    total = batch * length
    cache = KV4LayerCache.empty(total, batch * (sink + recent), hkv, d, device=device)
    perm = torch.randperm(total, device=device, generator=g)
    int4_pos, int8_pos = split_regions(length, sink=sink, recent=recent)
    kv_idx, side_idx = [], []
    for b in range(batch):
        slots = perm[b * length:(b + 1) * length]
        side = torch.full((length,), -1, dtype=torch.int64, device=device)
        side[int8_pos.to(device)] = torch.tensor([side_slot(b, int(p), sink=sink, recent=recent) for p in int8_pos],
                                                 device=device)
        for c0 in range(0, length, 8192):  # store in chunks to bound temporary memory
            c1 = min(length, c0 + 8192)
            k = torch.randn(c1 - c0, hkv, d, device=device, dtype=torch.bfloat16, generator=g)
            v = torch.randn(c1 - c0, hkv, d, device=device, dtype=torch.bfloat16, generator=g)
            kv4_store(cache, k, v, slots[c0:c1], side[c0:c1])
        kv_idx.append(slots[int4_pos.to(device)])
        side_idx.append(side[int8_pos.to(device)])
    n4, n8 = int4_pos.numel(), int8_pos.numel()
    kv_indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * n4
    side_indptr = torch.arange(batch + 1, device=device, dtype=torch.int32) * n8
    kv_indices = torch.cat(kv_idx).to(torch.int32)
    side_indices = torch.cat(side_idx).to(torch.int32)
    plan = plan_decode(kv_indptr, kv_indices, side_indptr, side_indices, num_kv_heads=hkv, **plan_kw)
    return cache, plan, dict(kv_indptr=kv_indptr, kv_indices=kv_indices, side_indptr=side_indptr,
                             side_indices=side_indices)


def run(shapes, hq=32, hkv=8, d=128, sink=16, recent=128, check=True):
    import triton

    from kvstreams_sglang.kernels import kv4_decode
    from kvstreams_sglang.kv4.reference import decode_reference

    device = torch.device("cuda")
    rows = []
    for batch, length in shapes:
        cache, plan, meta = build_kv4_case(batch, length, hq, hkv, d, sink, recent, device)
        q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
        err = None
        if check:
            nb = min(batch, 4)
            sub = dict(kv_indptr=meta["kv_indptr"][: nb + 1], side_indptr=meta["side_indptr"][: nb + 1],
                       kv_indices=meta["kv_indices"], side_indices=meta["side_indices"])
            ref, _ = decode_reference(q[:nb].float(), cache, **sub)
            out = kv4_decode(q.float(), cache, plan)[:nb]  # fp32 in and out: no bf16 output rounding
            err = float((out - ref).norm() / ref.norm())
        ms = triton.testing.do_bench(lambda q=q, c=cache, pl=plan: kv4_decode(q, c, pl), warmup=50, rep=300,
                                     return_mode="median")
        nbytes = kv4_bytes(batch, length, hq, hkv, d, sink, recent)
        rows.append(dict(batch=batch, length=length, splits=plan.num_splits, kv4_ms=ms, kv4_tb_s=nbytes / ms / 1e9,
                         kv4_bytes=nbytes, bf16_bytes=bf16_bytes(batch, length, hq, hkv, d), rel_err_vs_ref=err))
        print(f"B={batch:4d} L={length:6d} splits={plan.num_splits:3d} kv4 {ms:8.4f} ms "
              f"{nbytes / ms / 1e9:6.2f} TB/s  err={err}", flush=True)
        cache = plan = meta = q = None
        torch.cuda.empty_cache()
    return rows


def sweep(batch, length, hq=32, hkv=8, d=128, sink=16, recent=128):
    """Time launch configurations of the decode kernel on one shape (layout/tiling study)."""
    import dataclasses

    import triton

    from kvstreams_sglang.kernels import kv4_decode, plan_decode

    device = torch.device("cuda")
    cache, base, _ = build_kv4_case(batch, length, hq, hkv, d, sink, recent, device)
    q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
    nbytes = kv4_bytes(batch, length, hq, hkv, d, sink, recent)
    rows = []
    for block_n in (64, 128):
        for target in (512, 1024, 2048):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    plan = plan_decode(base.kv_indptr, base.kv_indices, base.side_indptr, base.side_indices,
                                       num_kv_heads=hkv, block_n=block_n, target_programs=target,
                                       num_warps=warps, num_stages=stages)
                    try:
                        ms = triton.testing.do_bench(lambda pl=plan: kv4_decode(q, cache, pl), warmup=25, rep=100,
                                                     return_mode="median")
                    except Exception as e:  # a config may not fit in shared memory
                        print("skip", block_n, target, warps, stages, type(e).__name__)
                        continue
                    row = dict(batch=batch, length=length, ms=ms, tb_s=nbytes / ms / 1e9,
                               **{k: v for k, v in dataclasses.asdict(plan).items() if isinstance(v, int)})
                    rows.append(row)
                    print(row, flush=True)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--sweep", default=None, help="B,L: time launch configurations on one shape")
    a = p.parse_args()
    if a.sweep:
        batch, length = map(int, a.sweep.split(","))
        rows = sweep(batch, length)
        best = min(rows, key=lambda r: r["ms"])
        print("best", best)
        out = a.out or os.path.join(os.environ.get("OUT", "bench/results"), "decode_sweep.json")
        with open(out, "w") as f:
            json.dump(dict(command=f"python -m bench.decode_attention --sweep {a.sweep}", rows=rows), f, indent=1)
        return
    shapes = [(32, 2048), (64, 2048), (128, 8192)] if a.quick else [
        (b, l) for b in (32, 64, 128, 256) for l in (1024, 2048, 4096, 8192, 16384, 32768) if b * l <= 2 ** 22]
    rows = run(shapes)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, host=platform.node(), rows=rows,
                  command="python -m bench.decode_attention" + (" --quick" if a.quick else ""))
    out = a.out or os.path.join(os.environ.get("OUT", "bench/results"), "decode_attention_h200.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

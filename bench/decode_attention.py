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


def kv4_bytes(lengths: list[int], hq: int, hkv: int, d: int, sink: int, recent: int) -> int:
    total = 0
    for length in lengths:
        prot = min(length, sink + recent)
        per_head = (length - prot) * 2 * (d // 2 + 4) + prot * 2 * (d + 2)
        total += hkv * per_head + length * 4 + hq * d * 2 * 2
    return total


def bf16_bytes(lengths: list[int], hq: int, hkv: int, d: int) -> int:
    return sum(hkv * length * 2 * d * 2 + length * 4 + hq * d * 2 * 2 for length in lengths)


def build_kv4_case(lengths, hq, hkv, d, sink, recent, device, seed=0, **plan_kw):
    """A KV4 cache holding one request per entry of ``lengths`` at shuffled page-size-1 slots."""
    from kvstreams_sglang.kernels import kv4_store, plan_decode
    from kvstreams_sglang.kv4 import KV4LayerCache, side_slot, split_regions

    g = torch.Generator(device=device).manual_seed(seed)
    batch, total = len(lengths), sum(lengths)
    cache = KV4LayerCache.empty(total, batch * (sink + recent), hkv, d, device=device)
    perm = torch.randperm(total, device=device, generator=g)
    kv_idx, side_idx, n4s, n8s, offset = [], [], [0], [0], 0
    for b, length in enumerate(lengths):
        int4_pos, int8_pos = split_regions(length, sink=sink, recent=recent)
        slots = perm[offset:offset + length]
        offset += length
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
        n4s.append(n4s[-1] + int4_pos.numel())
        n8s.append(n8s[-1] + int8_pos.numel())
    kv_indptr = torch.tensor(n4s, device=device, dtype=torch.int32)
    side_indptr = torch.tensor(n8s, device=device, dtype=torch.int32)
    kv_indices = torch.cat(kv_idx).to(torch.int32)
    side_indices = torch.cat(side_idx).to(torch.int32)
    plan = plan_decode(kv_indptr, kv_indices, side_indptr, side_indices, num_kv_heads=hkv, **plan_kw)
    return cache, plan, dict(kv_indptr=kv_indptr, kv_indices=kv_indices, side_indptr=side_indptr,
                             side_indices=side_indices)


def build_bf16_case(lengths, hkv, d, device, seed=1):
    """A BF16 paged cache (page size 1, shuffled slots): our kernel's plan and FlashInfer's CSR."""
    from kvstreams_sglang.kernels import plan_decode

    g = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    k = torch.randn(total, hkv, d, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(total, hkv, d, device=device, dtype=torch.bfloat16, generator=g)
    indices = torch.randperm(total, device=device, generator=g).to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
    empty = torch.zeros_like(indptr)
    plan = plan_decode(indptr, indices, empty, empty[:0], num_kv_heads=hkv, block_n=64, num_stages=2)
    return k, v, plan, indptr, indices


def flashinfer_decode(q, k, v, indptr, indices):
    """FlashInfer's BF16 tensor-core decode on the same page-size-1 cache, or None when absent."""
    try:
        import flashinfer
    except ImportError:
        return None
    batch, hq, d = q.shape
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
    last = torch.ones(batch, dtype=torch.int32, device=q.device)
    w.plan(indptr, indices, last, hq, k.shape[1], d, 1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    kc, vc = k.view(-1, 1, *k.shape[1:]), v.view(-1, 1, *v.shape[1:])
    return lambda: w.run(q, (kc, vc))


def timed_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def run(shapes, hq=32, hkv=8, d=128, sink=16, recent=128, check=True, baselines=True):
    """``shapes``: (name, lengths) pairs. Times KV4 decode (query prep + both regions + merge),
    our BF16 paged decode and FlashInfer's BF16 decode on the same shapes in one process."""
    from kvstreams_sglang.kernels import bf16_decode, kv4_decode
    from kvstreams_sglang.kv4.reference import decode_reference

    device = torch.device("cuda")
    rows = []
    for name, lengths in shapes:
        batch = len(lengths)
        cache, plan, meta = build_kv4_case(lengths, hq, hkv, d, sink, recent, device)
        q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
        err = None
        if check:
            nb = min(batch, 4)
            sub = dict(kv_indptr=meta["kv_indptr"][: nb + 1], side_indptr=meta["side_indptr"][: nb + 1],
                       kv_indices=meta["kv_indices"], side_indices=meta["side_indices"])
            ref, _ = decode_reference(q[:nb].float(), cache, **sub)
            out = kv4_decode(q.float(), cache, plan)[:nb]  # fp32 in and out: no bf16 output rounding
            err = float((out - ref).norm() / ref.norm())
        ms = timed_ms(lambda q=q, c=cache, pl=plan: kv4_decode(q, c, pl))
        nbytes = kv4_bytes(lengths, hq, hkv, d, sink, recent)
        row = dict(shape=name, batch=batch, max_length=max(lengths), mean_length=sum(lengths) / batch,
                   splits=plan.num_splits, kv4_ms=ms, kv4_tb_s=nbytes / ms / 1e9, kv4_bytes=nbytes,
                   bf16_bytes=bf16_bytes(lengths, hq, hkv, d), rel_err_vs_ref=err)
        cache = plan = meta = None
        torch.cuda.empty_cache()
        if baselines:
            k, v, bplan, indptr, indices = build_bf16_case(lengths, hkv, d, device)
            row["ours_bf16_ms"] = timed_ms(lambda q=q, k=k, v=v, p=bplan: bf16_decode(q, k, v, p, sm_scale=d ** -0.5))
            fi = flashinfer_decode(q, k, v, indptr, indices)
            if fi is not None:
                row["flashinfer_bf16_ms"] = timed_ms(fi)
                row["flashinfer_tb_s"] = row["bf16_bytes"] / row["flashinfer_bf16_ms"] / 1e9
                row["speedup_vs_flashinfer"] = row["flashinfer_bf16_ms"] / ms
            row["speedup_vs_ours_bf16"] = row["ours_bf16_ms"] / ms
            k = v = None
            torch.cuda.empty_cache()
        rows.append(row)
        nan = float("nan")
        print(f"{name:>14s} B={batch:4d} kv4 {ms:7.4f} ms {row['kv4_tb_s']:5.2f} TB/s | ours-bf16 "
              f"{row.get('ours_bf16_ms', nan):7.4f} | flashinfer {row.get('flashinfer_bf16_ms', nan):7.4f} ms"
              f" | x{row.get('speedup_vs_flashinfer', nan):.2f} vs FI  err={err}", flush=True)
    return rows


def sweep(batch, length, hq=32, hkv=8, d=128, sink=16, recent=128):
    """Time launch configurations of the decode kernel on one shape (layout/tiling study)."""
    import dataclasses

    import triton

    from kvstreams_sglang.kernels import kv4_decode, plan_decode

    device = torch.device("cuda")
    cache, base, _ = build_kv4_case([length] * batch, hq, hkv, d, sink, recent, device)
    q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
    nbytes = kv4_bytes([length] * batch, hq, hkv, d, sink, recent)
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
    p.add_argument("--no-baselines", action="store_true", help="time KV4 only (no BF16 / FlashInfer)")
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
    grid = [(32, 2048), (64, 2048), (128, 8192)] if a.quick else [
        (b, n) for b in (32, 64, 128, 256) for n in (1024, 2048, 4096, 8192, 16384, 32768) if b * n <= 2 ** 22]
    shapes = [(f"{b}x{n}", [n] * b) for b, n in grid]
    g = torch.Generator().manual_seed(0)  # mixed lengths within a batch: uniform 512..16k
    shapes += [(f"mixed{b}", torch.randint(512, 16385, (b,), generator=g).tolist()) for b in ((64,) if a.quick
                                                                                              else (64, 128, 256))]
    rows = run(shapes, baselines=not a.no_baselines)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, host=platform.node(), rows=rows,
                  command="python -m bench.decode_attention" + (" --quick" if a.quick else ""))
    out = a.out or os.path.join(os.environ.get("OUT", "bench/results"), "decode_attention_h200.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

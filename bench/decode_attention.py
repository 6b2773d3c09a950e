"""KV4 decode attention on the GPU: time, achieved bandwidth and correctness per shape.

Page size 1 with shuffled slot indices, random data; bytes counted are those the
kernel must read (INT4 codes + meta for the INT4 region, INT8 codes + scale for the
144-position side region, slot indices, the query) and write (the output).
Usage: ``python -m bench.decode_attention [--quick] [--graph] [--out bench/results/x.json]``; the one-command device
check (GPU tests + eager vs graph vs FlashInfer at 128x8k, 64x2k, 64x4k) is ``bench/device/decode_check.sh``.
Extends: ``--extend [--extend-sweep] [--extend-shapes B,L,N;...]`` (``kv4_extend`` against FlashInfer's BF16
prefill; the sweep adds the launch tiles and split-K counts per shape).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from typing import NamedTuple

import torch

from kvstreams_sglang.kernels.extend import ExtendTile


def kv4_bytes(lengths: list[int], hq: int, hkv: int, d: int, sink: int, recent: int) -> int:
    total = 0
    for length in lengths:
        prot = min(length, sink + recent)
        per_head = (length - prot) * 2 * (d // 2 + 4) + prot * 2 * (d + 2)
        total += hkv * per_head + length * 4 + hq * d * 2 * 2
    return total


def bf16_bytes(lengths: list[int], hq: int, hkv: int, d: int) -> int:
    return sum(hkv * length * 2 * d * 2 + length * 4 + hq * d * 2 * 2 for length in lengths)


def build_kv4_case(lengths, hq, hkv, d, sink, recent, device, seed=0):
    """A KV4 cache holding one request per entry of ``lengths`` at shuffled page-size-1 slots, and the CSR lists
    of both regions (``kv_indptr``, ``kv_indices``, ``side_indptr``, ``side_indices``)."""
    from kvstreams_sglang.kernels import kv4_store
    from kvstreams_sglang.kv4 import KV4LayerCache, side_slot, side_width, split_regions

    g = torch.Generator(device=device).manual_seed(seed)
    batch, total = len(lengths), sum(lengths)
    cache = KV4LayerCache.empty(total, batch * side_width(sink, recent), hkv, d, device=device)
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
    return cache, dict(kv_indptr=kv_indptr, kv_indices=kv_indices, side_indptr=side_indptr,
                       side_indices=side_indices)


def build_bf16_case(lengths, hkv, d, device, seed=1):
    """A BF16 paged cache (page size 1, shuffled slots): our kernel's plan and FlashInfer's CSR."""
    from kvstreams_sglang.kernels import TritonDecodeVariant, plan_decode

    g = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    k = torch.randn(total, hkv, d, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(total, hkv, d, device=device, dtype=torch.bfloat16, generator=g)
    indices = torch.randperm(total, device=device, generator=g).to(torch.int32)
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=device, dtype=torch.int32)
    empty = torch.zeros_like(indptr)
    plan = plan_decode(indptr, indices, empty, empty[:0], num_kv_heads=hkv, target_programs=1024, min_chunk=64,
                       triton_variant=TritonDecodeVariant(block_n=64, num_stages=2), cuda_variant=None)
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


TRITON_FIELDS = {"block_n", "num_warps", "num_stages", "prefetch", "block_h", "max_registers"}
CUDA_FIELDS = {"warps", "min_blocks", "pipe"}
PLAN_FIELDS = {"num_splits", "cuda_splits", "target_programs", "min_chunk"}


class Alt(NamedTuple):
    """A KV4 decode variant timed beside the shipped one: ``name:key=val,...`` (``parse_alts``)."""

    name: str
    triton: dict  # TritonDecodeVariant fields
    cuda: dict | None  # CudaDecodeVariant fields; None: the Triton kernel only (``triton=1``)
    plan: dict  # plan overrides (split counts)
    graph: bool  # a graph plan (per-request split sizes), launched eagerly


def parse_alts(text) -> list[Alt]:
    """``name:key=val,key=val;name:...`` -> alts. Keys: ``triton=1`` (the Triton kernel only), ``graph=1`` (a graph
    plan), TritonDecodeVariant fields (block_n, num_warps, num_stages, prefetch, block_h, max_registers),
    CudaDecodeVariant fields (warps, min_blocks, pipe) and split counts (num_splits, cuda_splits)."""
    alts = []
    for part in filter(None, (text or "").split(";")):
        name, _, spec = part.partition(":")
        tri, cu, plan, graph, only_triton = {}, {}, {}, False, False
        for item in filter(None, spec.split(",")):
            k, _, v = item.partition("=")
            if k == "triton":
                only_triton = bool(int(v))
            elif k == "graph":
                graph = bool(int(v))
            elif k in TRITON_FIELDS:
                tri[k] = int(v)
            elif k in CUDA_FIELDS:
                cu[k] = int(v)
            elif k in PLAN_FIELDS:
                plan[k] = int(v)
            else:
                raise ValueError(f"--alts: unknown key {k!r}")
        alts.append(Alt(name, tri, None if only_triton else cu, plan, graph))
    return alts


def workspace(alt: Alt | None, batch, hq, hkv, d, max_context, device):
    """A decode workspace running ``alt``'s variants (the shipped ones for None), graph-capable."""
    from kvstreams_sglang.kernels import CudaDecodeVariant, KV4DecodeWorkspace, TritonDecodeVariant

    tri = TritonDecodeVariant(**(alt.triton if alt else {}))
    cu = CudaDecodeVariant() if alt is None else None if alt.cuda is None else CudaDecodeVariant(**alt.cuda)
    return KV4DecodeWorkspace(batch, hq, hkv, d, max_context=max_context, device=device, max_side=144,
                              triton_variant=tri, cuda_variant=cu)


def graph_replay(ws, q, cache):
    """A CUDA graph of one layer's decode over the workspace's current (graph) plan, captured after a warm-up
    launch; returns the replay function."""
    ws.run(q, cache)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ws.run(q, cache)
    return g.replay


def timed_decode(ws, plan, q, cache, ref=None):
    """(ms, rel. error vs ``ref`` [first rows]) of ``ws`` over ``plan``; the check runs twice (the second call takes
    the packed launch) and keeps the larger error."""
    err = None
    if ref is not None:
        err = 0.0
        for _ in range(2):
            out = ws.decode(q.float(), cache, plan)[: ref.shape[0]]  # fp32 in and out: no bf16 output rounding
            err = max(err, float((out - ref).norm() / ref.norm()))
    return timed_ms(lambda: ws.decode(q, cache, plan)), err


def run(shapes, hq=32, hkv=8, d=128, sink=16, recent=128, check=True, baselines=True, on_row=None, alts=(),
        graph=False, max_context=32768):
    """``shapes``: (name, lengths) pairs. Times the shipped KV4 decode (query prep + both regions + merge, one launch
    from a workspace with an eager plan), our BF16 paged decode and FlashInfer's BF16 decode on the same shapes in
    one process. ``graph``: also the shipped kernel with a graph plan (split counts from the batch and
    ``max_context``, per-request split sizes on the device), launched eagerly (``graph_plan_ms``) and as a captured
    CUDA graph replay (``graph_replay_ms``). ``alts`` (``parse_alts``): further variants, each checked against the
    reference and timed."""
    from kvstreams_sglang.kernels import bf16_decode
    from kvstreams_sglang.kv4.reference import decode_reference

    device = torch.device("cuda")
    rows = []
    for name, lengths in shapes:
        batch = len(lengths)
        cache, meta = build_kv4_case(lengths, hq, hkv, d, sink, recent, device)
        q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
        nb = min(batch, 4)
        ref = None
        if check:  # the first rows' reference
            sub = dict(kv_indptr=meta["kv_indptr"][: nb + 1], side_indptr=meta["side_indptr"][: nb + 1],
                       kv_indices=meta["kv_indices"], side_indices=meta["side_indices"])
            ref, _ = decode_reference(q[:nb].float(), cache, **sub)

        ws = workspace(None, batch, hq, hkv, d, max_context if graph else None, device)
        plan = ws.plan(**meta)
        ms, err = timed_decode(ws, plan, q, cache, ref)
        kernel = ws.last_kernel
        row = dict(shape=name, batch=batch, max_length=max(lengths), mean_length=sum(lengths) / batch,
                   splits=plan.cuda_splits.num if kernel == "cuda" else plan.splits.num, int4_kernel=kernel,
                   kv4_ms=ms, rel_err_vs_ref=err)
        if graph:
            gplan = ws.plan(**meta, graph=True)
            gms, gerr = timed_decode(ws, gplan, q, cache, ref)
            replay = graph_replay(ws, q, cache)
            row.update(graph_splits=gplan.cuda_splits.num if ws.last_kernel == "cuda" else gplan.splits.num,
                       graph_kernel=ws.last_kernel, graph_plan_ms=gms, graph_rel_err_vs_ref=gerr,
                       graph_replay_ms=timed_ms(replay), max_context=max_context)
        alt_rows = {}
        for alt in alts:
            try:
                aws = workspace(alt, batch, hq, hkv, d, max_context if alt.graph else None, device)
                ap = aws.plan(**meta, graph=alt.graph, **{k: v for k, v in alt.plan.items()
                                                          if k in ("num_splits", "cuda_splits")})
                ams, aerr = timed_decode(aws, ap, q, cache, ref)
                acuda = aws.last_kernel == "cuda"
                alt_rows[alt.name] = dict(ms=ams, rel_err_vs_ref=aerr, splits=ap.cuda_splits.num if acuda
                                          else ap.splits.num, int4_kernel=aws.last_kernel)
            except Exception as e:  # a variant may not compile or fit
                alt_rows[alt.name] = dict(error=f"{type(e).__name__}: {str(e)[:200]}")
        nbytes = kv4_bytes(lengths, hq, hkv, d, sink, recent)
        row.update(kv4_tb_s=nbytes / ms / 1e9, kv4_bytes=nbytes, bf16_bytes=bf16_bytes(lengths, hq, hkv, d),
                   alts=alt_rows)
        cache = plan = meta = ws = None
        torch.cuda.empty_cache()
        if baselines:
            k, v, bplan, indptr, indices = build_bf16_case(lengths, hkv, d, device)
            row["ours_bf16_ms"] = timed_ms(lambda q=q, k=k, v=v, p=bplan: bf16_decode(q, k, v, p, sm_scale=d ** -0.5))
            fi = flashinfer_decode(q, k, v, indptr, indices)
            if fi is not None:
                row["flashinfer_bf16_ms"] = timed_ms(fi)
                row["flashinfer_tb_s"] = row["bf16_bytes"] / row["flashinfer_bf16_ms"] / 1e9
                row["speedup_vs_flashinfer"] = row["flashinfer_bf16_ms"] / ms
                for key in ("graph_plan_ms", "graph_replay_ms"):
                    if key in row:
                        row[key.replace("_ms", "_speedup_vs_flashinfer")] = row["flashinfer_bf16_ms"] / row[key]
            row["speedup_vs_ours_bf16"] = row["ours_bf16_ms"] / ms
            k = v = None
            torch.cuda.empty_cache()
        rows.append(row)
        nan = float("nan")
        print(f"{name:>14s} B={batch:4d} kv4 {ms:7.4f} ms {row['kv4_tb_s']:5.2f} TB/s | ours-bf16 "
              f"{row.get('ours_bf16_ms', nan):7.4f} | flashinfer {row.get('flashinfer_bf16_ms', nan):7.4f} ms"
              f" | x{row.get('speedup_vs_flashinfer', nan):.2f} vs FI  err={err} {row['int4_kernel']}"
              f" splits={row['splits']}", flush=True)
        if graph:
            fi_ms = row.get("flashinfer_bf16_ms", nan)
            print(f"{'':>14s}   graph plan {row['graph_plan_ms']:7.4f} ms x{fi_ms / row['graph_plan_ms']:.2f} | "
                  f"replay {row['graph_replay_ms']:7.4f} ms x{fi_ms / row['graph_replay_ms']:.2f} vs FI  "
                  f"err={row['graph_rel_err_vs_ref']} {row['graph_kernel']} splits={row['graph_splits']}", flush=True)
        for aname, ar in alt_rows.items():
            fi_ms = row.get("flashinfer_bf16_ms", nan)
            print(f"{'':>14s}   alt {aname:10s} " + (f"{ar['ms']:7.4f} ms x{fi_ms / ar['ms']:.2f} vs FI "
                                                      f"splits={ar['splits']} err={ar['rel_err_vs_ref']} "
                                                      f"{ar['int4_kernel']}"
                                                      if "ms" in ar else ar["error"]), flush=True)
        if on_row is not None:
            on_row(rows)
    return rows


def sweep(batch, length, hq=32, hkv=8, d=128, sink=16, recent=128):
    """Time launch configurations of the Triton decode kernel on one shape (layout/tiling study)."""
    import triton

    from kvstreams_sglang.kernels import KV4DecodeWorkspace, TritonDecodeVariant, plan_decode

    device = torch.device("cuda")
    cache, meta = build_kv4_case([length] * batch, hq, hkv, d, sink, recent, device)
    ws = KV4DecodeWorkspace(batch, hq, hkv, d, device=device)
    q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
    nbytes = kv4_bytes([length] * batch, hq, hkv, d, sink, recent)
    rows = []
    for block_n in (64, 128):
        for target in (512, 1024, 2048):
            for warps in (4, 8):
                for stages in (1, 2, 3):
                    tv = TritonDecodeVariant(block_n=block_n, num_warps=warps, num_stages=stages)
                    plan = plan_decode(**meta, num_kv_heads=hkv, target_programs=target, triton_variant=tv,
                                       cuda_variant=None)
                    try:
                        ms = triton.testing.do_bench(lambda pl=plan: ws.decode(q, cache, pl), warmup=25, rep=100,
                                                     return_mode="median")
                    except Exception as e:  # a config may not fit in shared memory
                        print("skip", block_n, target, warps, stages, type(e).__name__)
                        continue
                    row = dict(batch=batch, length=length, ms=ms, tb_s=nbytes / ms / 1e9, block_n=block_n,
                               target=target, num_warps=warps, num_stages=stages, num_splits=plan.splits.num,
                               chunk=plan.splits.chunk)
                    rows.append(row)
                    print(row, flush=True)
    return rows


def variants(shapes, hq=32, hkv=8, d=128, sink=16, recent=128):
    """Time Triton decode-kernel variants (block, warps, prefetch, split target) on a few shapes, after a
    correctness check of each variant family against the torch reference; then the store kernel."""
    import triton

    from kvstreams_sglang.kernels import KV4DecodeWorkspace, TritonDecodeVariant, plan_decode
    from kvstreams_sglang.kv4.reference import decode_reference

    device = torch.device("cuda")
    rows = []
    configs = [(16, 128, 4, True, 1), (16, 128, 4, False, 2), (4, 128, 4, False, 2), (4, 128, 8, False, 1),
               (4, 128, 8, False, 3), (4, 64, 4, False, 3), (4, 64, 8, False, 3), (4, 128, 4, True, 1)]
    for batch, length in shapes:
        cache, meta = build_kv4_case([length] * batch, hq, hkv, d, sink, recent, device)
        ws = KV4DecodeWorkspace(batch, hq, hkv, d, device=device)
        q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
        nb = min(batch, 4)
        sub = dict(kv_indptr=meta["kv_indptr"][: nb + 1], side_indptr=meta["side_indptr"][: nb + 1],
                   kv_indices=meta["kv_indices"], side_indices=meta["side_indices"])
        ref, ref_lse = decode_reference(q[:nb].float(), cache, **sub)
        nbytes = kv4_bytes([length] * batch, hq, hkv, d, sink, recent)
        seen = set()
        for bh, bn, w, pf, st in configs:
            for target in ((2048, 8192) if batch * length >= 2 ** 17 else (2048,)):
                tv = TritonDecodeVariant(block_h=bh, block_n=bn, num_warps=w, num_stages=st, prefetch=pf)
                plan = plan_decode(**meta, num_kv_heads=hkv, target_programs=target, triton_variant=tv,
                                   cuda_variant=None)
                if (bh, bn, w, pf, st, plan.splits.num) in seen:
                    continue
                seen.add((bh, bn, w, pf, st, plan.splits.num))
                try:
                    out, lse = ws.decode(q.float(), cache, plan, return_lse=True)
                    err = float((out[:nb] - ref).norm() / ref.norm())
                    lse_err = float((lse[:nb] - ref_lse).abs().max())
                    ms = triton.testing.do_bench(lambda pl=plan, q=q, c=cache, w=ws: w.decode(q, c, pl), warmup=25,
                                                 rep=150, return_mode="median")
                except Exception as e:
                    print("fail", batch, length, bh, bn, w, pf, st, target, type(e).__name__, str(e)[:200], flush=True)
                    continue
                row = dict(batch=batch, length=length, block_h=bh, block_n=bn, warps=w, prefetch=pf, stages=st,
                           target=target,
                           splits=plan.splits.num, ms=ms, tb_s=nbytes / ms / 1e9, rel_err=err, lse_err=lse_err)
                rows.append(row)
                print(f"{batch:4d}x{length:<6d} bh={bh:2d} bn={bn:3d} w={w} pf={int(pf)} st={st} "
                      f"splits={plan.splits.num:3d} {ms:8.4f} ms {row['tb_s']:5.2f} TB/s err={err:.1e} "
                      f"lse={lse_err:.1e}", flush=True)
        cache = meta = ws = None
        torch.cuda.empty_cache()
    return rows


def store_bench(n=262144, hkv=8, d=128, out=None, check=True):
    """Store kernel (rotate + quantise + scatter to shuffled slots) vs a device copy of the same bytes, in one
    process: the CUDA kernel (store_cuda.cu, v7; timed twice for the spread, and once with 1% side rows) and the
    Triton kernel's two best configurations (v3). ``check``: the CUDA kernel's entries at this shape against
    ``store_reference`` (V codes/meta bit-exact, K code flip rate). ``out``: write the rows as JSON there."""
    import triton

    from kvstreams_sglang.kernels import kv4_store
    from kvstreams_sglang.kv4 import KV4LayerCache
    from kvstreams_sglang.kv4.reference import store_reference

    device = torch.device("cuda")
    torch.manual_seed(0)
    cache = KV4LayerCache.empty(n, 4096, hkv, d, device=device)
    k = torch.randn(n, hkv, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(n, hkv, d, device=device, dtype=torch.bfloat16)
    slots = torch.randperm(n, device=device)
    side = torch.full((n,), -1, dtype=torch.int64, device=device)
    side1 = side.clone()  # 1% of the rows also get INT8 side copies (distinct side slots)
    pick = torch.randperm(n, device=device)[: n // 100]
    side1[pick] = torch.arange(pick.numel(), device=device)
    moved = 2 * n * hkv * (d * 2 + d // 2 + 4) + n * 16  # read bf16 K,V; write codes + meta; slot ids
    src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    rows = [dict(kind="copy", ms=copy_ms, tb_s=moved / copy_ms / 1e9)]
    runs = [("store cuda", side, dict(backend="cuda")), ("store cuda (again)", side, dict(backend="cuda")),
            ("store cuda 1% side rows", side1, dict(backend="cuda")),
            ("store bt=64 rot=tf32x3", side, dict(backend="triton", block_t=64, rot_prec="tf32x3")),
            ("store bt=32 rot=tf32", side, dict(backend="triton", block_t=32, rot_prec="tf32"))]
    snap = None
    for kind, sd, kw in runs:
        ms = triton.testing.do_bench(lambda sd=sd, kw=kw: kv4_store(cache, k, v, slots, sd, **kw),
                                     warmup=25, rep=200, return_mode="median")
        rows.append(dict(kind=kind, ms=ms, tb_s=moved / ms / 1e9, frac_of_copy=copy_ms / ms))
        if snap is None:  # the default CUDA kernel's INT4 entries: each variant below must write the same
            snap = [t.clone() for t in (cache.k_codes, cache.k_meta, cache.v_codes, cache.v_meta)]
    from kvstreams_sglang.kernels import store_cuda

    for opts in (dict(WARPS=4, LDHINT=0), dict(WARPS=4), dict(LDHINT=0)):  # store_cuda.cu variants (v7 first: 4 x 4)
        fn = store_cuda.kernel(hkv, k.dtype, device, opts)
        if fn is None:
            print("variant failed", store_cuda.KERNEL.errors, flush=True)
            continue
        ms = triton.testing.do_bench(lambda fn=fn: store_cuda.store(fn, cache, k, v, slots, side, True),
                                     warmup=25, rep=200, return_mode="median")
        same = all(torch.equal(a, b) for a, b in zip(snap, (cache.k_codes, cache.k_meta, cache.v_codes, cache.v_meta),
                                                      strict=True))
        rows.append(dict(kind="store cuda " + " ".join(f"{a}={b}" for a, b in opts.items()), ms=ms,
                         tb_s=moved / ms / 1e9, frac_of_copy=copy_ms / ms, same_entries_as_default=same))
    for r in rows:
        print(f"{r['kind']:44s} {r['ms']:8.4f} ms {r['tb_s']:5.2f} TB/s {r.get('frac_of_copy', 1):5.3f} of copy "
              f"{r.get('same_entries_as_default', '')}", flush=True)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, shape=dict(n=n, hkv=hkv, d=d),
                  bytes_moved=moved, rows=rows, command="python -m bench.decode_attention --store-only")
    if check:
        del src, dst, snap
        ours, ref = (KV4LayerCache.empty(n, 4096, hkv, d, device=device) for _ in range(2))
        kv4_store(ours, k, v, slots, side1, backend="cuda")
        store_reference(ref, k, v, slots, side1)
        used = side1[side1 >= 0].unique()
        result["check"] = dict(
            v_codes_equal=bool(torch.equal(ours.v_codes, ref.v_codes)),
            v_meta_equal=bool(torch.equal(ours.v_meta, ref.v_meta)),
            v_side_equal=bool(torch.equal(ours.v_side[used], ref.v_side[used])),
            k_code_flip_rate=float((ours.int4_k(slots).unpack_codes()
                                    != ref.int4_k(slots).unpack_codes()).float().mean()),
            k_meta_max_rel=float(((ours.k_meta.float() - ref.k_meta.float()).abs()
                                  / ref.k_meta.float().abs().clamp_min(1e-3)).max()))
        print("check", result["check"], flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return rows


# kv4_extend launch shapes timed by --extend-sweep (kernels.extend.ExtendTile: block_r, block_n, num_warps, words);
# ranked against the first, the default before the sweep (since: kernels.extend.GRID_TILE / SPLIT_TILE). The 256-row
# tiles (64 tokens x 4 heads) halve the prefix unpacking per query again: long turns (1 x 1,024 new over 8,192) ran
# at 0.35x FlashInfer BF16 with 128 rows on the H100 (extend_weak_h100.json)
EXTEND_TILES = tuple(ExtendTile(*t) for t in (
    (64, 64, 4, False), (64, 64, 4, True), (64, 32, 4, True), (64, 128, 4, True), (128, 32, 4, True),
    (128, 64, 4, True), (128, 64, 8, True), (128, 128, 8, True), (256, 32, 8, True), (256, 64, 8, True)))


EXTEND_SPLITS = (2, 4, 8, 16)  # --extend-sweep: split-K counts timed beside the shipped choice and unsplit


def parse_extend_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """``"B,L,N;B,L,N"`` -> ``((B, L, N), ...)``: B requests, each a KV4 prefix of L tokens and N new ones."""
    shapes = []
    for part in filter(None, text.split(";")):
        fields = part.split(",")
        if len(fields) != 3 or not all(f.strip().isdigit() and int(f) > 0 for f in fields):
            raise ValueError(f"--extend-shapes: {part!r} is not B,L,N (three positive integers: requests, prefix "
                             "tokens, new tokens each)")
        shapes.append(tuple(int(f) for f in fields))
    if not shapes:
        raise ValueError("--extend-shapes: no shape given (B,L,N;B,L,N;...)")
    return tuple(shapes)


def dequantized_prefix(cache, idx, i: int, dtype=torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Request ``i``'s cached prefix as ``dtype`` K/V ``[L, Hkv, D]`` (keys in the rotated basis): its INT8
    positions from the side cache, the others from INT4. The same set of keys the two-region attention reads, so
    full-precision attention over it is the two-region merge up to the query's INT8 rounding (a design for the
    extend: dequantise, then a BF16 prefill kernel)."""
    from kvstreams_sglang.kv4 import dequantize_int4, dequantize_int8

    s4 = idx["kv_indices"][idx["kv_indptr"][i]:idx["kv_indptr"][i + 1]].long()
    s8 = idx["side_indices"][idx["side_indptr"][i]:idx["side_indptr"][i + 1]].long()
    k = torch.cat((dequantize_int8(cache.int8_k(s8), dtype), dequantize_int4(cache.int4_k(s4), dtype)))
    v = torch.cat((dequantize_int8(cache.int8_v(s8), dtype), dequantize_int4(cache.int4_v(s4), dtype)))
    return k, v


def _extend_row(b, length, n, hq, hkv, d, device, sweep: bool = False):
    import triton

    from kvstreams_sglang.kernels import kv4_extend

    cache, idx = build_kv4_case([length] * b, hq, hkv, d, 16, 128, device)
    q = torch.randn(b * n, hq, d, device=device, dtype=torch.bfloat16)
    kn = torch.randn(b * n, hkv, d, device=device, dtype=torch.bfloat16)
    vn = torch.randn(b * n, hkv, d, device=device, dtype=torch.bfloat16)
    qo = torch.arange(b + 1, device=device, dtype=torch.int32) * n
    def kv4(splits=None, tile=None):
        return kv4_extend(q, kn, vn, qo, cache, idx["kv_indptr"], idx["kv_indices"], idx["side_indptr"],
                          idx["side_indices"], max_new_tokens=n, splits=splits, tile=tile)

    ms = triton.testing.do_bench(kv4, warmup=25, rep=200, return_mode="median")
    one = triton.testing.do_bench(lambda: kv4(1), warmup=25, rep=200, return_mode="median")
    splits_ms = {}
    if sweep:  # split-K counts at the default tiles (``extend_splits`` picks one from the grid size alone)
        for s in EXTEND_SPLITS:
            splits_ms[s] = triton.testing.do_bench(lambda s=s: kv4(s), warmup=10, rep=100, return_mode="median")
    from kvstreams_sglang.kernels.extend import GRID_TILE, extend_splits
    row = dict(batch=b, prefix=length, new=n, kv4_extend_ms=ms, new_tokens_per_s=b * n / ms * 1e3,
               splits=extend_splits(triton.cdiv(n, GRID_TILE.block_r // (hq // hkv)) * b * hkv, b * n, hq, d, device),
               kv4_extend_unsplit_ms=one, split_speedup=one / ms)
    if splits_ms:  # (the shipped choice is ``splits``, timed as kv4_extend_ms)
        row["splits_ms"] = {1: one, **splits_ms}
        row["best_splits"] = min(row["splits_ms"], key=row["splits_ms"].get)
    if sweep:  # the kernel's tiles: rows of (tokens x query heads) and prefix keys per program
        row["tiles_ms"] = {}
        row["tiles_rel_l2"] = {}  # each tile's output against the pre-sweep default's
        base = kv4(tile=EXTEND_TILES[0]).float()
        for tile in EXTEND_TILES:
            try:
                got = kv4(tile=tile).float()
                row["tiles_rel_l2"][tile.name()] = float((got - base).norm() / base.norm())
                row["tiles_ms"][tile.name()] = triton.testing.do_bench(
                    lambda tile=tile: kv4(tile=tile), warmup=10, rep=100, return_mode="median")
            except Exception as e:  # e.g. out of shared memory: recorded, the sweep goes on
                row["tiles_ms"][tile.name()] = repr(e)[:160]
    try:
        import flashinfer
    except ImportError:
        return row
    if sweep:  # the dequantise-then-BF16-prefill design, unfused (torch dequantisation): an upper bound of its cost
        from kvstreams_sglang.kv4.hadamard import hadamard

        def dequant_prefill():
            for i in range(b):
                k, v = dequantized_prefix(cache, idx, i)
                rows = slice(i * n, (i + 1) * n)
                flashinfer.single_prefill_with_kv_cache(hadamard(q[rows]), torch.cat((k, hadamard(kn[rows]))),
                                                        torch.cat((v, vn[rows])), causal=True)

        row["dequant_then_flashinfer_ms"] = triton.testing.do_bench(dequant_prefill, warmup=10, rep=100,
                                                                    return_mode="median")
    kf = torch.randn(length + n, hkv, d, device=device, dtype=torch.bfloat16)
    vf = torch.randn(length + n, hkv, d, device=device, dtype=torch.bfloat16)
    qs = q.view(b, n, hq, d)

    def bf16():
        for i in range(b):
            flashinfer.single_prefill_with_kv_cache(qs[i], kf, vf, causal=True)

    row["flashinfer_bf16_ms"] = triton.testing.do_bench(bf16, warmup=25, rep=200, return_mode="median")
    row["kv4_vs_bf16"] = row["flashinfer_bf16_ms"] / ms
    return row


def extend_bench(shapes=((1, 8192, 1024), (4, 4096, 512), (8, 2048, 256), (1, 3072, 231), (2, 4096, 128),
                         (1, 8192, 64), (4, 2048, 32), (16, 3072, 192)),  # the last: a rollout step's turns
                 hq=32, hkv=8, d=128, out=None, sweep: bool = False, command: str | None = None):
    """Extend/prefill: ``kv4_extend`` (B requests, each a prefix of L cached tokens in KV4 plus n new tokens
    attending causally; split-K as shipped and unsplit) vs FlashInfer's BF16 prefill on the same tokens held
    contiguous in BF16 (one ``single_prefill_with_kv_cache`` per request, causal aligned to the end), in one
    process."""
    rows = []
    for b, length, n in shapes:  # the JSON is rewritten after every shape: a run cut short keeps its rows
        rows.append(_extend_row(b, length, n, hq, hkv, d, torch.device("cuda"), sweep=sweep))
        print("extend", rows[-1], flush=True)
        result = dict(device=torch.cuda.get_device_name(), rows=rows, command=command or (
            "python -m bench.decode_attention --extend" + (" --extend-sweep" if sweep else "")))
        if sweep:
            result["tiles"] = rank_extend_tiles(rows)
        if out:
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    if sweep:
        print("extend tiles, best first:", result["tiles"], flush=True)
    return rows


def rank_extend_tiles(rows: list[dict]) -> list[dict]:
    """Each swept tile's geometric-mean time relative to the pre-sweep default (``EXTEND_TILES[0]``) over the rows,
    best first; a tile that failed or disagreed with its output (rel. L2 > 1e-2) on some shape ranks last."""
    default = EXTEND_TILES[0].name()
    ranked = []
    for tile in EXTEND_TILES:
        ratios = [r["tiles_ms"][tile.name()] / r["tiles_ms"][default] for r in rows
                  if isinstance(r["tiles_ms"].get(tile.name()), float) and isinstance(r["tiles_ms"].get(default), float)
                  and r["tiles_rel_l2"].get(tile.name(), 1.0) <= 1e-2]
        ok = len(ratios) == len(rows) and ratios
        ranked.append(dict(tile=tile.name(), vs_first=math.prod(ratios) ** (1 / len(ratios)) if ok else None))
    return sorted(ranked, key=lambda t: (t["vs_first"] is None, t["vs_first"] or 0.0))


def host_overhead(batch=32, length=1024, hq=32, hkv=8, d=128, iters=300):
    """Host time per call of the KV4 decode and its parts (launch-bound small shapes): back-to-back calls
    without synchronisation, so the GPU never limits the host loop when the kernels are short. ``kv4_graph_replay``:
    one layer's decode replayed from a CUDA graph (what SGLang's captured decode pays per layer: nothing on the
    host but the replay of the whole graph). ``kv4_extend``: one layer's extend (eager in SGLang: paid per layer of
    every prefill step) with 8 new tokens per request, split-K and not."""
    import time

    from kvstreams_sglang.kernels import kv4_extend, kv4_quantize_query

    device = torch.device("cuda")
    cache, meta = build_kv4_case([length] * batch, hq, hkv, d, 16, 128, device)
    q = torch.randn(batch, hq, d, device=device, dtype=torch.bfloat16)
    ws, tri = workspace(None, batch, hq, hkv, d, 32768, device), workspace(Alt("tri", {}, None, {}, False), batch,
                                                                           hq, hkv, d, None, device)
    plan, tplan = ws.plan(**meta), tri.plan(**meta)
    gws = workspace(None, batch, hq, hkv, d, 32768, device)
    gws.plan(**meta, graph=True)
    parts = dict(kv4_decode=lambda: ws.decode(q, cache, plan), kv4_triton=lambda: tri.decode(q, cache, tplan),
                 kv4_graph_replay=graph_replay(gws, q, cache), quantize_query=lambda: kv4_quantize_query(q),
                 empty_alloc=lambda: torch.empty(batch, hq, plan.splits.num + 1, d, device=device))
    new = 8
    qe = torch.randn(batch * new, hq, d, device=device, dtype=torch.bfloat16)
    ke, ve = (torch.randn(batch * new, hkv, d, device=device, dtype=torch.bfloat16) for _ in range(2))
    qo = torch.arange(batch + 1, device=device, dtype=torch.int32) * new
    for splits in (1, None):
        parts[f"kv4_extend_splits_{splits or 'auto'}"] = lambda splits=splits: kv4_extend(
            qe, ke, ve, qo, cache, **meta, max_new_tokens=new, splits=splits)
    rows = {}
    for name, fn in parts.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        rows[name] = (t1 - t0) / iters * 1e6
        print(f"host {name:16s} {rows[name]:7.1f} us/call", flush=True)
    print(f"kernels: {ws.last_kernel} (default), {tri.last_kernel} (tri); Triton direct launch active: "
          f"{tri._direct}, cached: {len(tri._compiled)}", flush=True)
    return rows


def extend_layer_overhead(batch=12, prefix=3072, new=180, hq=32, hkv=8, d=128, layers=36, repeats=10, out=None):
    """Host cost of one extend layer as SGLang's kv4rl backend runs it (``kv4_attention_step``: query prep, the
    extend kernel, the store), at a long-games prefill step's shape (12 requests x 180 new tokens over 3k prefixes,
    Qwen3-4B heads), with q/k/v as views of one fused projection like SGLang's. Host time per call from back-to-back
    calls without a sync (``layers`` calls = one step's attention), each part alone, the GPU time per call, and a
    torch-profiler count of what one step's ``layers`` calls launch and run on the host."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from kvstreams_sglang.kernels import kv4_extend, kv4_quantize_query, kv4_store
    from kvstreams_sglang.kernels.attend import kv4_attention_step

    device = torch.device("cuda")
    cache, meta = build_kv4_case([prefix] * batch, hq, hkv, d, 16, 128, device)
    n = batch * new
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device=device, dtype=torch.bfloat16)
    q, k, v = (x.view(n, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    qo = torch.arange(batch + 1, device=device, dtype=torch.int32) * new
    out_slots = torch.randperm(cache.k_codes.shape[0], device=device)[:n]
    side_slots = torch.full((n,), -1, dtype=torch.int64, device=device)
    step = dict(mode="extend", qo_indptr=qo, out_slots=out_slots, side_slots=side_slots, kv4=meta, sm_scale=d ** -0.5,
                use_triton=True, max_new_tokens=new)
    parts = dict(attention_step=lambda: kv4_attention_step(cache, q, k, v, **step),
                 quantize_query=lambda: kv4_quantize_query(q),
                 extend=lambda: kv4_extend(q, k, v, qo, cache, **meta, max_new_tokens=new),
                 store=lambda: kv4_store(cache, k, v, out_slots, side_slots),
                 empty_alloc=lambda: torch.empty(n, hq, d, device=device, dtype=torch.bfloat16))
    rows = {}
    for name, fn in parts.items():
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(layers * repeats):
            fn()
        host = (time.perf_counter() - t0) / (layers * repeats)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / (layers * repeats)
        rows[name] = dict(host_us=host * 1e6, wall_us=wall * 1e6)
        print(f"extend layer {name:16s} host {host * 1e6:7.1f} us/call, wall {wall * 1e6:7.1f} us/call", flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(layers):
            parts["attention_step"]()
        torch.cuda.synchronize()
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    top = [dict(name=e.key, calls=e.count // layers if e.count >= layers else e.count / layers,
                self_cpu_us_per_layer=e.self_cpu_time_total / layers) for e in ops[:25]]
    for t in top:
        print(f"  {t['name'][:60]:60s} {t['calls']:>6} calls/layer {t['self_cpu_us_per_layer']:8.1f} us/layer")
    result = dict(shape=dict(batch=batch, prefix=prefix, new=new, hq=hq, hkv=hkv, d=d, layers=layers), parts=rows,
                  profile_top_host_ops=top, command="python -m bench.decode_attention --extend-overhead")
    if out:
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--sweep", default=None, help="B,L: time launch configurations on one shape")
    p.add_argument("--no-baselines", action="store_true", help="time KV4 only (no BF16 / FlashInfer)")
    p.add_argument("--overhead", action="store_true", help="host time per KV4 decode call at B=32, L=1k")
    p.add_argument("--extend-overhead", action="store_true", help="host cost of one extend layer as the SGLang "
                   "backend runs it, its parts, and a profile of what it launches")
    p.add_argument("--store", action="store_true", help="with --variants: also time the store kernel")
    p.add_argument("--store-only", action="store_true", help="time the store kernels (CUDA, Triton) and the copy")
    p.add_argument("--extend", action="store_true", help="time kv4_extend against FlashInfer's BF16 prefill")
    p.add_argument("--extend-sweep", action="store_true", help="with --extend: the kernel's tiles (EXTEND_TILES) and "
                   "the dequantise-then-FlashInfer design, per shape, and split-K counts (EXTEND_SPLITS)")
    p.add_argument("--extend-shapes", default=None, help="with --extend: B,L,N;B,L,N;... (requests, prefix tokens, "
                   "new tokens each) instead of the default shapes, e.g. '16,10240,40' for full-context turns")
    p.add_argument("--alts", default=None, help="name:key=val,...;...: KV4 decode variants timed beside the shipped "
                   "kernel (parse_alts: triton=1, graph=1, Triton / CUDA variant fields, split counts)")
    p.add_argument("--graph", action="store_true", help="also the shipped kernel with a graph plan: launched eagerly "
                   "and replayed from a captured CUDA graph")
    p.add_argument("--max-context", type=int, default=32768, help="the server's maximum context for graph plans")
    p.add_argument("--previous", default="bench/results/decode_attention_h200.json",
                   help="an earlier table: its rows for these shapes are recorded beside the new ones")
    p.add_argument("--shapes", default=None, help="B,L;B,L;...: table rows to run instead of the full grid")
    p.add_argument("--variants", default=None, help="B,L;B,L;...: time decode kernel variants, then the store kernel")
    a = p.parse_args()
    if a.extend_shapes and not a.extend:
        p.error("--extend-shapes needs --extend")
    if a.store_only:
        store_bench(out=a.out or os.path.join(os.environ.get("OUT", "bench/results"), "decode_store_h200.json"))
        return
    if a.extend:
        kw = dict(shapes=parse_extend_shapes(a.extend_shapes)) if a.extend_shapes else {}
        extend_bench(out=a.out or os.path.join(os.environ.get("OUT", "bench/results"), "extend_h200.json"),
                     sweep=a.extend_sweep, command="python -m bench.decode_attention " + " ".join(sys.argv[1:]), **kw)
        return
    if a.overhead:
        host_overhead()
        return
    if a.extend_overhead:
        extend_layer_overhead(out=a.out or os.path.join(os.environ.get("OUT", "bench/results"),
                                                        "extend_overhead_h200.json"))
        return
    if a.variants:
        shapes = [tuple(map(int, x.split(","))) for x in a.variants.split(";")]
        result = dict(variants=variants(shapes), store=store_bench() if a.store else None,
                      command=f"python -m bench.decode_attention --variants '{a.variants}'")
        out = a.out or os.path.join(os.environ.get("OUT", "bench/results"), "decode_variants.json")
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        return
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
    if a.shapes:  # a subset of the table's rows, in the given order ("B,L" or "mixedB")
        by_name = dict(shapes)
        names = [x if x.startswith("mixed") else "x".join(x.split(",")) for x in a.shapes.split(";")]
        shapes = [(n, by_name[n]) for n in names]
    out = a.out or os.path.join(os.environ.get("OUT", "bench/results"), "decode_attention_h200.json")

    previous = {}
    if a.previous and os.path.exists(a.previous):
        with open(a.previous) as f:
            old = json.load(f)
        keep = ("kv4_ms", "flashinfer_bf16_ms", "speedup_vs_flashinfer", "splits", "int4_kernel")
        previous = dict(command=old.get("command"), rows={r["shape"]: {k: r.get(k) for k in keep}
                                                          for r in old.get("rows", []) if r["shape"] in dict(shapes)})

    def save(rows):  # after every shape, so a run cut short still leaves its rows
        import triton

        for row in rows:  # no FlashInfer here: the earlier table's FlashInfer time (same GPU model, another run)
            fi = previous.get("rows", {}).get(row["shape"], {}).get("flashinfer_bf16_ms")
            if "flashinfer_bf16_ms" not in row and fi:
                for key in ("kv4_ms", "graph_plan_ms", "graph_replay_ms"):
                    if key in row:
                        row[key.replace("_ms", "_speedup_vs_previous_flashinfer")] = fi / row[key]

        result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                      host=platform.node(), rows=rows, previous=previous,
                      command="python -m bench.decode_attention" + (" --quick" if a.quick else "")
                      + (f" --shapes '{a.shapes}'" if a.shapes else "") + (f" --alts '{a.alts}'" if a.alts else "")
                      + (f" --graph --max-context {a.max_context}" if a.graph else ""))
        with open(out, "w") as f:
            json.dump(result, f, indent=1)

    save(run(shapes, baselines=not a.no_baselines, on_row=save, alts=parse_alts(a.alts), graph=a.graph,
             max_context=a.max_context))


if __name__ == "__main__":
    main()

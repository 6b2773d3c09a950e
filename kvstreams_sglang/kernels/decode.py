"""Decode kernel: split-KV (flash-decoding) attention over the INT4 region and the INT8
side region of a page-size-1 KV4 cache, merged exactly by log-sum-exp.

Shape of the API follows FlashInfer: a ``KV4DecodeWorkspace`` owns what the kernels write
besides the output (partial outputs and LSEs of the splits, ticket counters, the Hadamard
block, per-layer launch arguments, and for CUDA graphs static copies of the index lists);
``ws.plan(...)`` builds the per-step metadata once (a ``DecodePlan``: index lists and the
split layout), ``ws.run(q, cache)`` runs one layer in one launch. ``kv4_decode(q, cache,
plan)`` is the plain function over a plan (a throwaway workspace unless one is given).

Triton kernel: grid ``(Hkv, NUM_SPLITS + 1, B)``: programs ``split < NUM_SPLITS`` each stream
one chunk of the request's INT4 slots, the last program of a (request, head) reads its INT8
side slots; all write a partial output and LSE, and the last of them to finish (a ticket
counter) merges them. Each program rotates and INT8-quantises its own query rows first. One
program serves all ``GROUP = Hq / Hkv`` query heads of its KV head, so each KV byte is read
once (GQA).

Why the arithmetic looks like this (KV4-RL): the query is INT8 (rotated into the keys'
Hadamard basis), keys are INT4 codes ``c`` with per-vector ``scale, offset``, so
``q.k ~ s_q (scale (q8 . c) + offset sum(q8))``: the dot is an exact integer dot on the
tensor cores and the affine correction is two FMAs per score. Values: ``P V =
(P * scale_v) c_v + (P . offset_v)``, an fp16 dot plus a per-row sum; PV
accumulates in fp32. Reference: ``kv4.reference.decode_reference``.

On an H100/H200 the step runs as the CUDA kernel of ``decode_cuda.cu`` instead (one CTA per
(split, request) over all KV heads, all reductions inside a warp, a bulk-copy ring in shared
memory, the side region and the merge in the same launch; bench/NOTES.md v5-v7) wherever the
plan has a ``CudaDecodeVariant`` and the shapes fit; everywhere else (CPU interpreter, other
shapes or dtypes) this Triton kernel does it.

Split sizes: an eager plan sizes every split by the step's longest INT4 list (one host sync in
``plan_decode``). A graph plan (``ws.plan(..., graph=True)``) fixes the split count from the
batch size and the server's maximum context, and both kernels size each request's splits from
its own length on the device (``chunk <= 0``): a captured CUDA graph replays fixed grids and
scalar arguments while lengths and slots change every step.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver

from ..kv4.cache import KV4LayerCache
from ..kv4.hadamard import hadamard_matrix
from . import decode_cuda
from .decode_cuda import CachePointers, CudaDecodeKernel, CudaDecodeVariant, Launcher, StepPointers
from .quantize import int8_codes, rotate_halves_sylvester
from .tiles import int4_load_w, int4_math_w, int8_region

LOG2E = 1.4426950408889634
FP16_MAGIC = 0x64006400  # two fp16 1024.0: the nibble-to-fp16 bit trick (tiles.nibbles_centred_fp16)


@triton.jit
def _widen(slot, OFF64: tl.constexpr):
    """Slot ids as int64 only when some code or meta offset needs more than 31 bits."""
    if OFF64:
        slot = slot.to(tl.int64)
    return slot


@triton.jit
def _decode_kernel(
    Q, Hmat, KvIndptr, KvIndices, SideIndptr, SideIndices,
    KCodes, KMeta32, VCodes, VMeta32, KSide, KSideScale, VSide, VSideScale,
    PartOut, PartLse, Counter, Out, LseOut,
    sm_scale_log2, chunk, magic,
    HKV: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PREFETCH: tl.constexpr, USE_ASM: tl.constexpr, OFF64: tl.constexpr,
    ROTATE: tl.constexpr,
):
    # Grid (Hkv, splits + 1, B): the KV heads of one (request, split) are neighbours in launch order, so
    # they walk the same slots together and the 32-byte sector holding all heads' meta words of a slot
    # is fetched from DRAM once and then served from L2 to the other head programs.
    # One launch per decode step: each program rotates and INT8-quantises its own GROUP query rows (the
    # query kernel's arithmetic), and the last program of a (request, KV head) to finish merges the
    # partial states of all splits (a ticket counter), so no separate query or merge launch is needed.
    # Every tensor is contiguous (the launcher checks), so all strides are compile-time constants: fewer
    # launch arguments (Triton's per-argument launch cost dominates small decode steps) and immediate
    # address arithmetic.
    stride_qb: tl.constexpr = HKV * GROUP * 2 * HALF
    stride_qh: tl.constexpr = 2 * HALF
    stride_cs: tl.constexpr = HKV * HALF
    stride_ch: tl.constexpr = HALF
    stride_ws: tl.constexpr = HKV
    stride_wh: tl.constexpr = 1
    stride_ss: tl.constexpr = HKV * 2 * HALF
    stride_sh: tl.constexpr = 2 * HALF
    stride_scs: tl.constexpr = HKV
    stride_sch: tl.constexpr = 1
    hk = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    num_hkv = HKV
    hrow = tl.arange(0, BLOCK_H)
    hmask = hrow < GROUP
    qh = hk * GROUP + hrow
    d = tl.arange(0, HALF)

    q_ptr = Q + b * stride_qb + qh[:, None] * stride_qh + d[None, :]
    x_lo = tl.load(q_ptr, mask=hmask[:, None], other=0.0).to(tl.float32)
    x_hi = tl.load(q_ptr + HALF, mask=hmask[:, None], other=0.0).to(tl.float32)
    if ROTATE:
        x_lo, x_hi = rotate_halves_sylvester(x_lo, x_hi, Hmat, HALF, "ieee")
    q_lo, q_hi, q_scale = int8_codes(x_lo, x_hi)  # [BLOCK_H, HALF] int8 (0 in padding rows), fp16 scale
    sq = q_scale.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_lo = tl.zeros([BLOCK_H, HALF], tl.float32)
    acc_hi = tl.zeros([BLOCK_H, HALF], tl.float32)

    if split < NUM_SPLITS:
        # ---- INT4 region: one chunk of the request's slots ----
        start = tl.load(KvIndptr + b)
        length = tl.load(KvIndptr + b + 1) - start
        # chunk <= 0: this request's own split size (a graph plan: the grid and the arguments are fixed, the
        # lengths are read here), ceil(length / NUM_SPLITS) rounded up to a tile
        per_request = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
        chunk_b = tl.where(chunk > 0, chunk, per_request)
        lo = split * chunk_b
        hi = tl.minimum(lo + chunk_b, length)
        q_sum = (tl.sum(q_lo.to(tl.int32), 1) + tl.sum(q_hi.to(tl.int32), 1)).to(tl.float32)
        qs = sq * sm_scale_log2
        acc_off = tl.zeros([BLOCK_H], tl.float32)
        ar = tl.arange(0, BLOCK_N)
        if PREFETCH:
            # Software pipeline over page-size-1 gathers: tile i's math runs while tile i+1's codes
            # and tile i+2's slot ids are in flight.
            nmask = lo + ar < hi
            slot = _widen(tl.load(KvIndices + start + lo + ar, mask=nmask, other=0), OFF64)
            kc, kw, vc, vw = int4_load_w(slot, nmask, hk, KCodes, KMeta32, VCodes, VMeta32, stride_cs, stride_ch,
                                         stride_ws, stride_wh, HALF)
            mask_next = lo + BLOCK_N + ar < hi
            slot_next = _widen(tl.load(KvIndices + start + lo + BLOCK_N + ar, mask=mask_next, other=0), OFF64)
            for n0 in range(lo, hi, BLOCK_N):
                kc_n, kw_n, vc_n, vw_n = int4_load_w(slot_next, mask_next, hk, KCodes, KMeta32, VCodes, VMeta32,
                                                     stride_cs, stride_ch, stride_ws, stride_wh, HALF)
                mask_after = n0 + 2 * BLOCK_N + ar < hi
                slot_after = _widen(tl.load(KvIndices + start + n0 + 2 * BLOCK_N + ar, mask=mask_after,
                                             other=0), OFF64)
                m_i, l_i, acc_lo, acc_hi, acc_off = int4_math_w(q_lo, q_hi, qs, q_sum, m_i, l_i, acc_lo, acc_hi,
                                                                acc_off, nmask, kc, kw, vc, vw, magic, USE_ASM)
                kc, kw, vc, vw = kc_n, kw_n, vc_n, vw_n
                nmask, mask_next, slot_next = mask_next, mask_after, slot_after
        else:
            for n0 in range(lo, hi, BLOCK_N):
                nmask = n0 + ar < hi
                slot = _widen(tl.load(KvIndices + start + n0 + ar, mask=nmask, other=0), OFF64)
                kc, kw, vc, vw = int4_load_w(slot, nmask, hk, KCodes, KMeta32, VCodes, VMeta32, stride_cs,
                                             stride_ch, stride_ws, stride_wh, HALF)
                m_i, l_i, acc_lo, acc_hi, acc_off = int4_math_w(q_lo, q_hi, qs, q_sum, m_i, l_i, acc_lo, acc_hi,
                                                                acc_off, nmask, kc, kw, vc, vw, magic, USE_ASM)
        acc_lo += acc_off[:, None]
        acc_hi += acc_off[:, None]
    else:
        # ---- INT8 side region: sink and recent positions ----
        m_i, l_i, acc_lo, acc_hi = int8_region(
            q_lo, q_hi, sq * sm_scale_log2, m_i, l_i, acc_lo, acc_hi, SideIndptr, SideIndices, b, hk,
            KSide, KSideScale, VSide, VSideScale, stride_ss, stride_sh, stride_scs, stride_sch, BLOCK_N, HALF)

    # An empty chunk leaves l_i = 0: it writes out = 0 and lse = -inf, which the merge ignores.
    PARTS: tl.constexpr = NUM_SPLITS + 1
    denom = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(denom), float("-inf"))
    row = b * (num_hkv * GROUP) + qh  # (request, query head) row of the partial and final outputs
    o_ptr = PartOut + (row[:, None] * PARTS + split) * (2 * HALF) + d[None, :]
    tl.store(o_ptr, acc_lo / denom[:, None], mask=hmask[:, None])
    tl.store(o_ptr + HALF, acc_hi / denom[:, None], mask=hmask[:, None])
    tl.store(PartLse + row * PARTS + split, lse, mask=hmask)

    # Ticket: the barrier orders every thread's partial stores before the (gpu-scope, acq_rel) atomic;
    # the program that draws the last ticket sees all parts of its (request, KV head) and merges them.
    tl.debug_barrier()
    ticket = tl.atomic_add(Counter + b * num_hkv + hk, 1, sem="acq_rel", scope="gpu")
    if ticket == PARTS - 1:
        _merge_parts(PartOut, PartLse, Out, LseOut, row, hmask, d, PARTS, BLOCK_H, HALF)
        tl.atomic_xchg(Counter + b * num_hkv + hk, 0)  # ready for the next step's launch


@triton.jit
def _merge_parts(PartOut, PartLse, Out, LseOut, row, hmask, d, PARTS: tl.constexpr, BLOCK_H: tl.constexpr,
                 HALF: tl.constexpr):
    """Exact log-sum-exp merge of the ``PARTS`` partial states of ``row [BLOCK_H]`` (L2 loads: other programs
    wrote them)."""
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    for s in range(PARTS):
        m = tl.maximum(m, tl.load(PartLse + row * PARTS + s, mask=hmask, other=float("-inf"),
                                  cache_modifier=".cg"))
    m = tl.where(m == float("-inf"), 0.0, m)
    total = tl.zeros([BLOCK_H], tl.float32)
    out_lo = tl.zeros([BLOCK_H, HALF], tl.float32)
    out_hi = tl.zeros([BLOCK_H, HALF], tl.float32)
    for s in range(PARTS):
        w = tl.exp2(tl.load(PartLse + row * PARTS + s, mask=hmask, other=float("-inf"),
                            cache_modifier=".cg") - m)  # 0 for empty parts
        p_ptr = PartOut + (row[:, None] * PARTS + s) * (2 * HALF) + d[None, :]
        out_lo += w[:, None] * tl.load(p_ptr, mask=hmask[:, None], other=0.0, cache_modifier=".cg")
        out_hi += w[:, None] * tl.load(p_ptr + HALF, mask=hmask[:, None], other=0.0, cache_modifier=".cg")
        total += w
    den = tl.where(total > 0, total, 1.0)
    f_ptr = Out + row[:, None] * (2 * HALF) + d[None, :]
    tl.store(f_ptr, (out_lo / den[:, None]).to(Out.dtype.element_ty), mask=hmask[:, None])
    tl.store(f_ptr + HALF, (out_hi / den[:, None]).to(Out.dtype.element_ty), mask=hmask[:, None])
    tl.store(LseOut + row, tl.where(total > 0, m + tl.log2(den), float("-inf")), mask=hmask)


@triton.jit
def _merge_kernel(
    PartOut, PartLse, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
    Out, LseOut, stride_ob, stride_oh, stride_lob,
    NUM_PARTS: tl.constexpr, PARTS_P2: tl.constexpr, D: tl.constexpr,
):
    """Exact softmax merge of the partial states of one (request, query head)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, PARTS_P2)
    smask = s < NUM_PARTS
    d = tl.arange(0, D)
    lse = tl.load(PartLse + b * stride_lb + h * stride_lh + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)  # 0 for empty parts
    o = tl.load(PartOut + b * stride_pb + h * stride_ph + s[:, None] * stride_ps + d[None, :],
                mask=smask[:, None], other=0.0)
    total = tl.sum(w, 0)
    denom = tl.where(total > 0, total, 1.0)
    out = tl.sum(w[:, None] * o, 0) / denom
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty))
    tl.store(LseOut + b * stride_lob + h, tl.where(total > 0, m + tl.log2(denom), float("-inf")))



def use_asm(device: torch.device) -> bool:
    """Inline PTX (the word-wide nibble unpack) on a CUDA device; the interpreter has none."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def meta_words(meta: torch.Tensor) -> torch.Tensor:
    """``[S, Hkv, 2]`` fp16 (scale, offset) as ``[S, Hkv]`` int32 words: one load per vector."""
    if meta.stride(-1) != 1 or meta.stride(-2) % 2 or meta.stride(0) % 2:
        meta = meta.contiguous()
    return meta.view(torch.int32).squeeze(-1)


@dataclass(frozen=True)
class TritonDecodeVariant:
    """Launch configuration of the Triton decode kernel (the CPU-tested path and the fallback). Defaults from the
    H200 sweeps (bench/NOTES.md v3, v4): 64-slot tiles, 4 warps, 3 stages of Triton's async copies (no hand-written
    prefetch), 4 query-head rows per program, a 96-register cap (5 programs per SM, no spills)."""

    block_n: int = 64  # INT4 slots per tile; split sizes are multiples of it
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = False  # software-pipeline the INT4 loop (tile i+1's loads before tile i's math)
    block_h: int = 4  # query-head rows per program (raised to GROUP's next power of two)
    max_registers: int | None = 96  # ptxas cap (the kernel is latency bound: a 5th program per SM pays)


TRITON_DEFAULT = TritonDecodeVariant()
CUDA_SHIPPED = CudaDecodeVariant()  # the v7 kernel


class Splits(NamedTuple):
    """How a kernel splits each request's INT4 list."""

    num: int  # splits per request (the Triton kernel's NUM_SPLITS, the CUDA kernel's grid y)
    chunk: int  # INT4 slots per split; 0: each request's own, ceil(len / num) rounded up to a tile, on the device


@dataclass(frozen=True)
class DecodePlan:
    """Per-step decode metadata: CSR index lists of both regions and each kernel's split layout."""

    kv_indptr: torch.Tensor  # [B+1] int32, INT4 region
    kv_indices: torch.Tensor  # [nnz4] slot ids
    side_indptr: torch.Tensor  # [B+1] int32, INT8 region
    side_indices: torch.Tensor  # [nnz8] side slot ids
    splits: Splits  # the Triton kernel's (its parts: splits + the side region's)
    cuda_splits: Splits  # the CUDA kernel's (its parts: the splits; each takes a share of the side region)
    triton: TritonDecodeVariant = TRITON_DEFAULT
    cuda: CudaDecodeVariant | None = CUDA_SHIPPED  # None: the Triton kernel only
    graph: bool = False  # a workspace's graph plan: its lists are the workspace's static buffers

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.numel() - 1


def triton_split_count(batch: int, max_len: int, num_kv_heads: int, *, target_programs: int = 2048,
                       min_chunk: int = 256, block_n: int = 64) -> int:
    """Enough splits to give ``target_programs`` programs (several waves on a 132-SM H200) without splits shorter
    than ``min_chunk`` slots (a pipelined loop of one or two tiles is mostly prologue), rounded down to a power of
    two: it is a compile-time constant of the kernel, and an engine whose batch and lengths change every step
    would otherwise compile a variant for each value."""
    want = max(1, math.ceil(target_programs / max(1, batch * num_kv_heads)))
    num = max(1, min(want, max_len // max(min_chunk, block_n)))
    return 1 << (num.bit_length() - 1)


def cuda_split_count(batch: int, max_len: int, *, even: bool = True) -> int:
    """The CUDA kernel's splits per request (CTAs of all KV heads, up to 2 per SM on the H200's 132 SMs).
    Even lengths (v6 split sweep, bench/NOTES.md): the fewest splits that give >= 128 CTAs, at least 2 (one CTA per
    SM pulls the bandwidth; fewer, longer CTAs pay less prologue, ring fill and merge), raised to >= 256 CTAs once a
    split would exceed 4096 INT4 slots (v7: 64x16k, 64x32k, 32x32k 10-13% faster); splits of >= 256 slots.
    Uneven lengths (v5): a split is sized by the longest request, so more, shorter ones balance the SMs: ~1056 CTAs,
    rounded down to a power of two."""
    if even:
        want = max(2, math.ceil(128 / max(1, batch)))
        if max_len / want > 4096:
            want = max(want, math.ceil(256 / max(1, batch)))
        return max(1, min(want, max_len // 256))
    num = max(1, min(math.ceil(1056 / max(1, batch)), max_len // 256))
    return 1 << (num.bit_length() - 1)


# Batch-invariant plans: every request's INT4 list cut into this many parts of its own size, whatever the batch
# (a row's partial sums, and so its rounding, then depend on its list alone; ``KV4DecodeWorkspace(invariant=True)``)
INVARIANT_SPLITS = 4


def plan_decode(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, side_indptr: torch.Tensor,
                side_indices: torch.Tensor, *, num_kv_heads: int, max_context: int | None = None,
                num_splits: int | None = None, cuda_splits: int | None = None, target_programs: int = 2048,
                min_chunk: int = 256, triton_variant: TritonDecodeVariant = TRITON_DEFAULT,
                cuda_variant: CudaDecodeVariant | None = CUDA_SHIPPED, invariant: bool = False) -> DecodePlan:
    """Build the decode metadata once per step.

    Eager (``max_context`` None): split counts from the step's longest INT4 list (one host sync) and every split
    sized by it (``triton_split_count``, ``cuda_split_count``). With ``max_context`` (the longest INT4 list any
    request can have): no host sync, split counts from the batch size and ``max_context`` alone, and per-request
    split sizes computed by the kernels (``Splits.chunk`` 0): a plan a CUDA graph can replay. ``num_splits`` /
    ``cuda_splits`` override the counts (tests, bench). ``cuda_variant`` None: the Triton kernel only.
    ``invariant``: both kernels cut every request into ``INVARIANT_SPLITS`` parts of its own size (no host sync):
    a row's output no longer depends on the batch it runs in (its split count and sizes would otherwise follow the
    batch size and the longest list), at the cost of the split rules' balance."""
    batch = kv_indptr.numel() - 1
    per_request = max_context is not None or invariant
    if invariant:  # both counts fixed, each split sized per request
        num_splits = cuda_splits = INVARIANT_SPLITS
        max_len, even = 0, True  # (unused)
    elif per_request:  # the graph rule: the even-length rule at the longest length a request can have
        max_len, even = max_context, True
    else:
        lengths = kv_indptr[1:] - kv_indptr[:-1]
        max_len = int(lengths.max()) if lengths.numel() else 0
        even = kv_indices.numel() >= 0.75 * batch * max_len
    num_splits = num_splits or triton_split_count(batch, max_len, num_kv_heads, target_programs=target_programs,
                                                  min_chunk=min_chunk, block_n=triton_variant.block_n)
    cuda_splits = cuda_splits or cuda_split_count(batch, max_len, even=even)

    def chunk(num: int, tile: int) -> int:
        return 0 if per_request else _cdiv(_cdiv(max(max_len, 1), num), tile) * tile

    return DecodePlan(kv_indptr.to(torch.int32), kv_indices, side_indptr.to(torch.int32), side_indices,
                      Splits(num_splits, chunk(num_splits, triton_variant.block_n)),
                      Splits(cuda_splits, chunk(cuda_splits, decode_cuda.TILE)), triton_variant, cuda_variant)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class DecodeBuffers(NamedTuple):
    """What the kernels write besides the output, flat (the kernels compute their own offsets)."""

    part_out: torch.Tensor  # >= B * Hq * parts * D fp32: each split's normalised partial output
    part_lse: torch.Tensor  # >= B * Hq * parts fp32: its log2-domain LSE (-inf: empty)
    lse: torch.Tensor  # >= B * Hq fp32: the final LSE when the caller does not ask for it
    counters: torch.Tensor  # >= B * Hkv int32 tickets; zero between launches (the merging program resets its own)

    @classmethod
    def empty(cls, rows_parts: int, rows: int, hq: int, hkv: int, d: int, device) -> DecodeBuffers:
        f32 = dict(dtype=torch.float32, device=device)
        return cls(torch.empty(rows_parts * hq * d, **f32), torch.empty(rows_parts * hq, **f32),
                   torch.empty(rows * hq, **f32), torch.zeros(rows * hkv, dtype=torch.int32, device=device))

    def fits(self, bsz: int, parts: int, hq: int, hkv: int, d: int) -> bool:
        return (self.part_lse.numel() >= bsz * parts * hq and self.part_out.numel() >= bsz * parts * hq * d
                and self.lse.numel() >= bsz * hq and self.counters.numel() >= bsz * hkv)


class KV4DecodeWorkspace:
    """Everything the KV4 decode kernels need besides the query, the layer cache and the output, owned by whoever
    makes it (the attention backend, the engine, a benchmark; FlashInfer's wrapper shape): the splits' partial
    outputs and LSEs, the ticket counters, the Hadamard block of the Triton kernel's query rotation, the per-layer
    launch arguments (packed once per layer cache) and the Triton direct-launch handles.

    Eager use: ``plan(...)`` once per step (today's split rule; the lists are used as given), ``run(q, cache)`` per
    layer. CUDA graphs (``max_context`` given): ``plan(..., graph=True, batch_size=bs)`` copies the lists into
    static buffers of fixed capacity (``max_bs + 1`` indptr entries, ``max_bs * max_context`` INT4 slot ids,
    ``max_bs * max_side`` side slot ids) and fixes the split counts from (bs, ``max_context``); ``run`` under a
    capture then records launches whose grids and scalar arguments do not change between replays, reading
    everything that changes (the lists, each request's split size) from device memory. Call ``plan(graph=True)``
    eagerly before every replay, and run once eagerly before capturing (the first run compiles the kernels).
    ``invariant``: every plan batch-invariant (``plan_decode``), eager or graph.
    Static buffers (and graph-plan partial buffers) are allocated once here and never moved; eager partial buffers
    grow as needed. One step at a time per workspace (the launches of the layers share the partial buffers, in
    stream order)."""

    def __init__(self, max_bs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 max_context: int | None = None, device="cuda", *, max_side: int | None = None,
                 triton_variant: TritonDecodeVariant = TRITON_DEFAULT,
                 cuda_variant: CudaDecodeVariant | None = CUDA_SHIPPED, invariant: bool = False):
        if num_q_heads % num_kv_heads:
            raise ValueError(f"KV4DecodeWorkspace: Hq={num_q_heads} is not a multiple of Hkv={num_kv_heads}")
        self.max_bs, self.num_q_heads, self.num_kv_heads, self.head_dim = max_bs, num_q_heads, num_kv_heads, head_dim
        self.max_context, self.device = max_context, torch.device(device)
        self.triton_variant, self.cuda_variant = triton_variant, cuda_variant  # what its plans run
        self.invariant = invariant  # batch-invariant plans (``plan_decode``'s ``invariant``)
        self.hadamard = hadamard_matrix(head_dim, device=self.device)  # fp32, the Triton kernel's rotation block
        self.current_plan: DecodePlan | None = None
        self.last_kernel = ""  # "cuda" or "triton": which kernel the last call ran (bench, tests)
        self._eager: DecodeBuffers | None = None  # grown on demand
        self._graph: DecodeBuffers | None = None
        self._static: tuple[torch.Tensor, ...] | None = None  # kv_indptr, kv_indices, side_indptr, side_indices
        if max_context is not None:
            i32 = dict(dtype=torch.int32, device=self.device)
            side = max_side if max_side is not None else max_context
            self._static = (torch.zeros(max_bs + 1, **i32), torch.zeros(max(1, max_bs * max_context), **i32),
                            torch.zeros(max_bs + 1, **i32), torch.zeros(max(1, max_bs * side), **i32))
            if invariant:
                rows_parts = max_bs * (INVARIANT_SPLITS + 1)
            else:
                rows_parts = max(b * max(triton_split_count(b, max_context, num_kv_heads,
                                                            block_n=triton_variant.block_n) + 1,
                                         cuda_split_count(b, max_context)) for b in range(1, max_bs + 1))
            self._graph = DecodeBuffers.empty(rows_parts, max_bs, num_q_heads, num_kv_heads, head_dim, self.device)
        self._cuda_fns: dict[tuple, CudaDecodeKernel | None] = {}
        self._launchers: dict[tuple, Launcher | None] = {}  # (cache pointers, Hkv, q dtype, scale, rotate, variant)
        self._step: tuple | None = None  # (plan, buffers, StepPointers) of the last CUDA launch
        self._compiled: dict[tuple, object] = {}  # Triton specialisation key -> CompiledKernel (direct launch)
        self._direct = True  # cleared (for good) if the direct launch ever rejects its arguments

    # ---- plan: once per step ----

    def plan(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, side_indptr: torch.Tensor,
             side_indices: torch.Tensor, *, batch_size: int | None = None, graph: bool = False,
             num_splits: int | None = None, cuda_splits: int | None = None) -> DecodePlan:
        """The step's plan (also kept as ``current_plan`` for ``run``). Eager: ``plan_decode`` over the given lists.
        ``graph``: the lists are copied into the static buffers (rows past ``kv_indptr``'s, up to ``batch_size``,
        get empty lists: their output is 0), no host sync; ``batch_size`` is the captured batch (default: the
        lists' own) and at most ``max_bs``."""
        if not graph:
            plan = plan_decode(kv_indptr, kv_indices, side_indptr, side_indices, num_kv_heads=self.num_kv_heads,
                               num_splits=num_splits, cuda_splits=cuda_splits, triton_variant=self.triton_variant,
                               cuda_variant=self.cuda_variant, invariant=self.invariant)
        else:
            plan = self._graph_plan(kv_indptr, kv_indices, side_indptr, side_indices, batch_size, num_splits,
                                    cuda_splits)
        self.current_plan = plan
        return plan

    def _graph_plan(self, kv_indptr, kv_indices, side_indptr, side_indices, batch_size, num_splits, cuda_splits):
        if self._static is None:
            raise ValueError("KV4DecodeWorkspace: a graph plan needs max_context (static buffers)")
        rows = kv_indptr.numel() - 1
        bs = rows if batch_size is None else batch_size
        if not rows <= bs <= self.max_bs:
            raise ValueError(f"KV4DecodeWorkspace: {rows} requests in a graph batch of {bs} (max_bs {self.max_bs})")
        s_indptr, s_indices, s_side_indptr, s_side_indices = self._static
        if kv_indices.numel() > s_indices.numel() or side_indices.numel() > s_side_indices.numel():
            raise ValueError(f"KV4DecodeWorkspace: {kv_indices.numel()} INT4 / {side_indices.numel()} side slots do "
                             f"not fit the static buffers ({s_indices.numel()} / {s_side_indices.numel()})")
        for src, dst in ((kv_indptr, s_indptr), (side_indptr, s_side_indptr)):
            dst[: rows + 1].copy_(src)
            if bs > rows:  # padding rows: empty lists
                dst[rows + 1: bs + 1].copy_(src[rows:].expand(bs - rows))
        s_indices[: kv_indices.numel()].copy_(kv_indices)
        s_side_indices[: side_indices.numel()].copy_(side_indices)
        return self.static_plan(bs, num_splits, cuda_splits)

    def static_lists(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The static buffers a graph plan of ``batch_size`` requests reads (kv_indptr [bs + 1], kv_indices,
        side_indptr [bs + 1], side_indices), for a planner that writes them in place (``region_plan``'s ``out``)."""
        if self._static is None:
            raise ValueError("KV4DecodeWorkspace: static lists need max_context")
        s_indptr, s_indices, s_side_indptr, s_side_indices = self._static
        return s_indptr[: batch_size + 1], s_indices, s_side_indptr[: batch_size + 1], s_side_indices

    def static_plan(self, batch_size: int, num_splits: int | None = None,
                    cuda_splits: int | None = None) -> DecodePlan:
        """The graph plan of ``batch_size`` requests over the static lists as they stand: a function of the batch
        size alone (split counts from it and ``max_context``, split sizes per request on the device)."""
        plan = plan_decode(*self.static_lists(batch_size), num_kv_heads=self.num_kv_heads,
                           max_context=self.max_context, num_splits=num_splits, cuda_splits=cuda_splits,
                           triton_variant=self.triton_variant, cuda_variant=self.cuda_variant,
                           invariant=self.invariant)
        return dataclasses.replace(plan, graph=True)

    # ---- run: once per layer ----

    def run(self, q: torch.Tensor, cache: KV4LayerCache, sm_scale: float | None = None, *, rotate: bool = True,
            return_lse: bool = False):
        """One layer over ``current_plan`` (``kv4_decode``'s arguments and result)."""
        if self.current_plan is None:
            raise RuntimeError("KV4DecodeWorkspace.run before plan")
        return self.decode(q, cache, self.current_plan, sm_scale=sm_scale, rotate=rotate, return_lse=return_lse)

    def decode(self, q: torch.Tensor, cache: KV4LayerCache, plan: DecodePlan, *, sm_scale: float | None = None,
               rotate: bool = True, return_lse: bool = False):
        """``q [B, Hq, D]`` -> ``out [B, Hq, D]`` (q's dtype, fp32 for fp64 input); with ``return_lse`` also the
        natural-log LSE ``[B, Hq]``. The CUDA kernel where the plan has a variant and the shapes fit, else the
        Triton kernel."""
        bsz, hq, d = q.shape
        hkv = cache.num_kv_heads
        if hq % hkv or d != cache.head_dim or bsz != plan.batch_size:
            raise ValueError(f"kv4_decode: q {tuple(q.shape)} does not fit cache Hkv={hkv}, D={cache.head_dim} "
                             f"and plan batch {plan.batch_size}")
        sm_scale = sm_scale if sm_scale is not None else d ** -0.5
        q = q.contiguous()
        out = torch.empty(bsz, hq, d, dtype=torch.float32 if q.dtype == torch.float64 else q.dtype, device=q.device)
        lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device) if return_lse else None
        ptrs = _cache_pointers(cache)
        self.last_kernel = "cuda"
        if not (plan.cuda is not None and self._cuda_launch(q, cache, plan, ptrs, out, lse, sm_scale, rotate)):
            self.last_kernel = "triton"
            self._triton_launch(q, cache, plan, ptrs, out, lse, sm_scale, rotate)
        return (out, lse / LOG2E) if return_lse else out

    def _buffers(self, plan: DecodePlan, bsz: int, parts: int, hq: int, hkv: int, d: int) -> DecodeBuffers:
        """A graph plan's partial buffers are the static ones (a captured launch keeps their addresses); an eager
        plan's grow on demand."""
        if plan.graph and self._graph is not None:
            if not self._graph.fits(bsz, parts, hq, hkv, d):
                raise ValueError(f"KV4DecodeWorkspace: a graph plan of {bsz} x {parts} parts x {hq} heads does not fit "
                                 f"the static buffers (max_bs {self.max_bs}, Hq {self.num_q_heads})")
            return self._graph
        if self._eager is None or not self._eager.fits(bsz, parts, hq, hkv, d):
            old = self._eager
            grow = (lambda n, m: max(n, m + m // 2)) if old is not None else (lambda n, m: n)
            rows = grow(bsz, old.lse.numel() // hq if old is not None else 0)
            rows_parts = grow(bsz * parts, old.part_lse.numel() // hq if old is not None else 0)
            self._eager = DecodeBuffers.empty(rows_parts, max(rows, self.max_bs), hq, hkv, d, self.device)
        return self._eager

    def _cuda_launch(self, q, cache, plan, ptrs: CachePointers, out, lse, sm_scale: float, rotate: bool) -> bool:
        """Launch the CUDA kernel; False where it does not run here (then the Triton kernel does)."""
        key = (ptrs, cache.k_codes.shape[1], q.dtype, sm_scale, rotate, plan.cuda)  # what the packed launch bakes
        launcher = self._launchers.get(key, False)
        if launcher is False:
            launcher = self._launchers[key] = self._make_launcher(q, cache, plan, ptrs, sm_scale, rotate)
        if launcher is None or q.data_ptr() % 16:
            return False
        hit = self._step
        if hit is not None and hit[0] is plan and hit[1] is (self._graph if plan.graph and self._graph is not None
                                                             else self._eager):
            bufs, step = hit[1], hit[2]
        else:
            bsz, hq, d = q.shape
            bufs = self._buffers(plan, bsz, plan.cuda_splits.num, hq, cache.num_kv_heads, d)
            step = StepPointers(plan.kv_indptr.data_ptr(), plan.kv_indices.data_ptr(), plan.side_indptr.data_ptr(),
                                plan.side_indices.data_ptr(), bufs.part_out.data_ptr(), bufs.part_lse.data_ptr(),
                                bufs.counters.data_ptr(), plan.cuda_splits.num, plan.cuda_splits.chunk, bsz)
            if any(p % 16 for p in step[:7]) or plan.kv_indices.dtype != torch.int32 or (
                    plan.side_indices.dtype != torch.int32):
                return False  # the kernel's vector loads need 16-byte aligned tensors: the Triton kernel instead
            self._step = (plan, bufs, step)
        launcher.bind(step)
        launcher(q.data_ptr(), out.data_ptr(), (lse if lse is not None else bufs.lse).data_ptr(),
                 driver.active.get_current_stream(q.device.index))
        return True

    def _make_launcher(self, q, cache, plan, ptrs: CachePointers, sm_scale: float, rotate: bool) -> Launcher | None:
        """The layer's packed launch, or None where the CUDA kernel does not take these shapes or did not compile."""
        hkv, d = cache.num_kv_heads, cache.head_dim
        if not decode_cuda.supported(q, hkv, q.shape[1] // hkv, d, plan.kv_indices):
            return None
        if (any(p % 16 for p in ptrs) or not _contiguous(cache) or cache.k_side.dtype != torch.int8
                or cache.k_side_scale.dtype != torch.float16):
            return None
        fkey = (q.dtype, hkv, q.device.index, plan.cuda)
        if fkey not in self._cuda_fns:
            self._cuda_fns[fkey] = decode_cuda.kernel(hkv, q.dtype, q.device, plan.cuda)
        fn = self._cuda_fns[fkey]
        return None if fn is None else Launcher(fn, hkv, ptrs, sm_scale * LOG2E, FP16_MAGIC, rotate)

    def _triton_launch(self, q, cache: KV4LayerCache, plan: DecodePlan, ptrs: CachePointers, out, lse,
                       sm_scale: float, rotate: bool) -> None:
        bsz, hq, d = q.shape
        hkv = cache.num_kv_heads
        tv, splits = plan.triton, plan.splits
        bufs = self._buffers(plan, bsz, splits.num + 1, hq, hkv, d)
        lse = lse if lse is not None else bufs.lse
        asm = use_asm(q.device)
        off64 = cache.k_codes.numel() > 2**31 or cache.k_meta.numel() // 2 > 2**31  # offsets < numel
        head = (q, self.hadamard, plan.kv_indptr, plan.kv_indices, plan.side_indptr, plan.side_indices)
        tail = (bufs.part_out, bufs.part_lse, bufs.counters, out, lse)
        scalars = (sm_scale * LOG2E, splits.chunk, FP16_MAGIC)
        constexprs = dict(  # in the kernel's parameter order (the direct launch passes them positionally)
            HKV=hkv, GROUP=hq // hkv, BLOCK_H=max(tv.block_h, triton.next_power_of_2(hq // hkv)),
            BLOCK_N=tv.block_n, HALF=d // 2, NUM_SPLITS=splits.num, PREFETCH=tv.prefetch, USE_ASM=asm, OFF64=off64,
            ROTATE=rotate)
        options = dict(num_warps=tv.num_warps, num_stages=tv.num_stages,
                       **({"maxnreg": tv.max_registers} if tv.max_registers else {}))
        grid = (hkv, splits.num + 1, bsz)
        key = None
        if asm and _contiguous(cache):
            head_ptrs = tuple(x.data_ptr() for x in head)
            tail_ptrs = tuple(x.data_ptr() for x in tail)
            if all(p % 16 == 0 for p in head_ptrs + tail_ptrs + ptrs):  # what Triton's first launch specialised on
                key = (q.device.index, q.dtype, out.dtype, plan.kv_indices.dtype, plan.side_indices.dtype,
                       splits.chunk % 16, splits.chunk == 1, *constexprs.values(), *options.items())
                kernel = self._compiled.get(key) if self._direct else None
                if kernel is not None and knobs.runtime.launch_enter_hook is None:
                    try:
                        stream = driver.active.get_current_stream(q.device.index)
                        kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, None, None, None,
                                   *head_ptrs, *ptrs, *tail_ptrs, *scalars, *constexprs.values())
                        return
                    except (TypeError, ValueError, AttributeError):  # the launcher's argument parsing: Triton's path
                        self._compiled.clear()
                        self._direct = False
                        key = None
        c = cache
        cache_tensors = tuple(x if x.is_contiguous() else x.contiguous()  # strides are the kernel's constants
                              for x in (c.k_codes, meta_words(c.k_meta), c.v_codes, meta_words(c.v_meta), c.k_side,
                                        c.k_side_scale, c.v_side, c.v_side_scale))
        kernel = _decode_kernel[grid](*head, *cache_tensors, *tail, *scalars, **constexprs, **options)
        if key is not None and self._direct and kernel is not None and hasattr(kernel, "packed_metadata"):
            if list(constexprs) != _decode_kernel.arg_names[len(head) + 8 + len(tail) + len(scalars):]:
                raise AssertionError("kv4_decode: constexprs out of the kernel's parameter order")
            self._compiled[key] = kernel


def _cache_pointers(cache: KV4LayerCache) -> CachePointers:
    """The cache's 8 kernel arguments as addresses (meta words: the fp16 pairs' address). Every call computes them
    (a few hundred ns): they key the packed launches, so a layer cache is recognised by what the kernel reads."""
    c = cache
    return CachePointers(c.k_codes.data_ptr(), c.k_meta.data_ptr(), c.v_codes.data_ptr(), c.v_meta.data_ptr(),
                         c.k_side.data_ptr(), c.k_side_scale.data_ptr(), c.v_side.data_ptr(),
                         c.v_side_scale.data_ptr())


def _contiguous(cache: KV4LayerCache) -> bool:
    """The kernels' strides are compile-time constants: a cache with a strided tensor runs the Triton kernel on
    contiguous copies."""
    c = cache
    return all(t.is_contiguous() for t in (c.k_codes, c.k_meta, c.v_codes, c.v_meta, c.k_side, c.k_side_scale,
                                           c.v_side, c.v_side_scale))


def kv4_decode(q: torch.Tensor, cache: KV4LayerCache, plan: DecodePlan, *, workspace: KV4DecodeWorkspace | None = None,
               sm_scale: float | None = None, rotate: bool = True, return_lse: bool = False):
    """One decode step of one layer: ``q [B, Hq, D]`` -> ``out [B, Hq, D]`` (q's dtype, fp32 for fp64 input); with
    ``return_lse`` also the natural-log LSE ``[B, Hq]``. ``workspace``: where the partial results go (the caller's,
    reused across layers and steps); None makes a throwaway one for this call (tests, studies: allocations per call,
    but the compiled kernels are shared)."""
    if workspace is None:
        bsz, hq, d = q.shape
        workspace = KV4DecodeWorkspace(bsz, hq, cache.num_kv_heads, d, device=q.device)
    return workspace.decode(q, cache, plan, sm_scale=sm_scale, rotate=rotate, return_lse=return_lse)

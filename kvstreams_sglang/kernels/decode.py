"""Decode kernel: split-KV (flash-decoding) attention over the INT4 region and the INT8
side region of a page-size-1 KV4 cache, merged exactly by log-sum-exp.

Shape of the API follows FlashInfer: ``plan_decode`` builds the per-step metadata once
(index lists and the split size), ``kv4_decode`` runs one layer in one launch. Grid ``(Hkv,
NUM_SPLITS + 1, B)``: programs ``split < NUM_SPLITS`` each stream one chunk of the request's
INT4 slots, the last program of a (request, head) reads its INT8 side slots; all write a
partial output and LSE, and the last of them to finish (a ticket counter) merges them. Each
program rotates and INT8-quantises its own query rows first. One program serves all
``GROUP = Hq / Hkv`` query heads of its KV head, so each KV byte is read once (GQA).

Why the arithmetic looks like this (KV4-RL): the query is INT8 (rotated into the keys'
Hadamard basis), keys are INT4 codes ``c`` with per-vector ``scale, offset``, so
``q.k ~ s_q (scale (q8 . c) + offset sum(q8))``: the dot is an exact integer dot on the
tensor cores and the affine correction is two FMAs per score. Values: ``P V =
(P * scale_v) c_v + (P . offset_v)``, an fp16 dot on codes plus a per-row sum; PV
accumulates in fp32. Reference: ``kv4.reference.decode_reference``.

On an H100/H200 the step can instead run as the CUDA kernel of ``decode_cuda.cu`` (one CTA per (split, request)
over all KV heads, all reductions inside a warp, a bulk-copy ring in shared memory; bench/NOTES.md v5, v6):
``kv4_decode`` takes it where the plan selects it (``cuda_int4``; by default always when fused, ``cuda_fuse``) and
it compiled. Fused (v6 default), that one launch also does the INT8 side region (a share per split CTA) and the
merge; unfused (v5), this kernel follows in its ``SIDE_MERGE`` mode for the side region and the merge (then the
CUDA kernel is taken from ``CUDA_AUTO_MIN_TOKEN_HEADS`` INT4 token-heads per step on). Everywhere else (CPU
interpreter, other shapes or dtypes) this kernel does it all.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver

from ..kv4.cache import KV4LayerCache
from .quantize import device_hadamard, int8_codes, rotate_halves_sylvester
from .tiles import int4_load_w, int4_math_w, int8_tile

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
    ROTATE: tl.constexpr, SIDE_MERGE: tl.constexpr,
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
    # SIDE_MERGE (grid (Hkv, 1, B), launched after the CUDA INT4 kernel of decode_cuda.py on the same stream):
    # each program is the side-region part of its (request, KV head) and merges all parts itself, no ticket.
    hk = tl.program_id(0)
    split = tl.program_id(1) + NUM_SPLITS * SIDE_MERGE
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
        x_lo, x_hi = rotate_halves_sylvester(x_lo, x_hi, Hmat, HALF)
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
        lo = split * chunk
        hi = tl.minimum(lo + chunk, length)
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
        start = tl.load(SideIndptr + b)
        length = tl.load(SideIndptr + b + 1) - start
        qs = sq * sm_scale_log2
        for n0 in range(0, length, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = n < length
            slot = tl.load(SideIndices + start + n, mask=nmask, other=0).to(tl.int64)
            m_i, l_i, acc_lo, acc_hi = int8_tile(
                q_lo, q_hi, qs, m_i, l_i, acc_lo, acc_hi, slot, nmask, hk,
                KSide, KSideScale, VSide, VSideScale, stride_ss, stride_sh, stride_scs, stride_sch, HALF)

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
    if SIDE_MERGE:
        _merge_parts(PartOut, PartLse, Out, LseOut, row, hmask, d, PARTS, BLOCK_H, HALF)
    else:
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


_COUNTERS: dict = {}


def ticket_counters(n: int, device: torch.device) -> torch.Tensor:
    """Zeroed int32 ticket counters, one per (request, KV head); the merging program resets its own,
    so the buffer stays zero between launches (one stream at a time per device)."""
    key = str(device)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
        _COUNTERS[key] = buf
    return buf


def use_asm(device: torch.device) -> bool:
    """Inline PTX (the word-wide nibble unpack) on a CUDA device; the interpreter has none."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1"


def meta_words(meta: torch.Tensor) -> torch.Tensor:
    """``[S, Hkv, 2]`` fp16 (scale, offset) as ``[S, Hkv]`` int32 words: one load per vector."""
    if meta.stride(-1) != 1 or meta.stride(-2) % 2 or meta.stride(0) % 2:
        meta = meta.contiguous()
    return meta.view(torch.int32).squeeze(-1)


@dataclass(frozen=True)
class DecodePlan:
    """Per-step decode metadata: CSR index lists of both regions and the split layout."""

    kv_indptr: torch.Tensor  # [B+1] int32, INT4 region
    kv_indices: torch.Tensor  # [nnz4] slot ids
    side_indptr: torch.Tensor  # [B+1] int32, INT8 region
    side_indices: torch.Tensor  # [nnz8] side slot ids
    num_splits: int
    chunk: int  # INT4 slots per split, a multiple of block_n
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = False  # software-pipeline the INT4 loop (tile i+1's loads before tile i's math)
    block_h: int = 4  # query-head rows per program (raised to GROUP's next power of two); was 16 in v2
    # ptxas cap: 96 fits 5 programs of 4 warps per SM (128 fitted 4) with no spills in the INT4 loop at d=128;
    # the kernel is latency bound, so the 5th program pays (H200: 24 of 26 table shapes faster, v4 in NOTES.md)
    max_registers: int | None = 96
    # INT4 region by the CUDA kernel (decode_cuda.py; GPU only, d=128, GQA group 4): -1 auto (taken where it won
    # on the H200, see cuda_auto_min_tokens), 0 never, 1 whenever supported. Its own split layout: one CTA per
    # (split, request) over all KV heads, cuda_splits INT4 splits of cuda_chunk slots (a multiple of 32).
    cuda_int4: int = -1
    cuda_splits: int = 1
    cuda_chunk: int = 32
    cuda_min_blocks: int = 2  # __launch_bounds__ min CTAs per SM (2 of 8 warps: 128 registers, no spills)
    cuda_warps: int = 8  # KV heads (warps) per CTA, 0: all
    cuda_tma: int = 1  # 1: the ring is one per CTA, filled by bulk copies (cp.async.bulk, mbarriers); needs cuda_pipe
    cuda_pipe: int = 2  # 0: next tile prefetched into registers; S >= 2: S-stage cp.async ring in shared memory
    cuda_fuse: int = 1  # 1: the CUDA kernel also does the INT8 side region and the merge (one launch per step, v6)
    cuda_issue: int = 1  # bulk-copy producers: 1 uniform-operand code copies + cp.async meta (v6), 0 as v5
    cuda_early: int = 0  # 1: the ring's stages (all of them) issued at kernel start, before the query and side (v7)
    cuda_merge: int = 0  # 1: the merging CTA reads the splits' parts in one pass (v7)
    cuda_side_ctas: int = 0  # fused: S > 0 more CTAs per request take the INT8 side region alone (v7); 0 split shares
    cuda_wgroups: int = 1  # fused: warps per KV head; 2: CTAs of 16 warps, one per SM, alternate tiles (v8)
    cuda_wside: int = 0  # with cuda_wgroups 2: group 0 streams the INT4 region, group 1 the side share beside it (v8)
    cuda_ablate: int = 0  # bench attribution only (decode_cuda.cu ABLATE: parts of the work left out, wrong results)
    int4_tokens: int = 0  # INT4 slots of the step (kv_indices' length), for the auto choice
    # Per-step host state the launcher fills on first use (workspaces, the per-layer launch arguments): not
    # part of the plan's identity, and ``dataclasses.replace`` starts a new one.
    _host: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.numel() - 1


def plan_decode(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, side_indptr: torch.Tensor,
                side_indices: torch.Tensor, *, num_kv_heads: int, num_splits: int | None = None,
                block_n: int = 64, target_programs: int = 2048, num_warps: int = 4, num_stages: int = 3,
                prefetch: bool = False, min_chunk: int = 256, cuda_int4: int = -1, cuda_target_ctas: int | None = None,
                cuda_min_chunk: int = 256, cuda_splits: int | None = None, cuda_rule: int = 7,
                cuda_side: int = 0) -> DecodePlan:
    """Build the decode metadata once per step (one host sync for the longest INT4 list).

    ``num_splits`` defaults to enough splits to give ``target_programs`` programs (several
    waves on a 132-SM H200) without splits shorter than ``min_chunk`` slots (a pipelined loop of
    one or two tiles is mostly prologue), rounded down to a power of two: it is a compile-time
    constant of the kernel, and an engine whose batch and lengths change every step would
    otherwise compile a variant for each value. Launch defaults from the H200 variant sweep
    (bench/results/decode_variants_v3_h200.json): 64-slot tiles, 4 warps, 3 pipeline stages of
    Triton's async copies (no hand-written prefetch), 4 query-head rows per program (``kv4_decode``).
    CUDA kernel (bench/NOTES.md v6, bench/NOTES.md v7 decode): ``cuda_rule`` picks its split rule for even lengths
    (6: v6; 7, default: 2 CTAs per SM once a split would exceed 4096 slots; 8: wherever splits keep >= 2000 slots);
    ``cuda_side`` its side-region CTAs per request (0: none, the split CTAs take shares; -1: auto; k: k).
    """
    lengths = kv_indptr[1:] - kv_indptr[:-1]
    max_len = int(lengths.max()) if lengths.numel() else 0
    batch = kv_indptr.numel() - 1
    if num_splits is None:
        want = max(1, math.ceil(target_programs / max(1, batch * num_kv_heads)))
        num_splits = max(1, min(want, max_len // max(min_chunk, block_n)))
        num_splits = 1 << (num_splits.bit_length() - 1)
    chunk = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), block_n) * block_n
    if cuda_splits is None:  # CUDA kernel: CTAs of all KV heads, up to 2 per SM (132 SMs on the H200)
        if cuda_target_ctas is None and kv_indices.numel() >= 0.75 * batch * max_len:
            # even lengths (v6 split sweep, bench/NOTES.md): the fewest splits that give >= 128 CTAs, at least 2
            # (at most one CTA per SM pulls the bandwidth; fewer, longer CTAs pay less prologue, ring fill, merge)
            want = max(2, math.ceil(128 / max(1, batch)))
            more = max(want, math.ceil(256 / max(1, batch)))
            if (cuda_rule == 7 and max_len / want > 4096) or (cuda_rule >= 8 and max_len / more >= 2000):
                # v7: long requests of a small batch: 2 CTAs per SM (>= 256 CTAs) once a split would exceed 4096 INT4
                # slots (64x16k, 64x32k, 32x32k: 10-13% faster, bench/NOTES.md v7 decode). Rule 8: wherever the
                # splits keep >= 2000 slots (also 32x16k: 9% faster measured; 64x8k not measured)
                want = more
            cuda_splits = max(1, min(want, max_len // cuda_min_chunk))
        else:  # uneven lengths: a split is sized by the longest request, more, shorter ones balance the SMs (v5)
            cuda_target_ctas = cuda_target_ctas or 1056
            cuda_splits = max(1, min(math.ceil(cuda_target_ctas / max(1, batch)), max_len // cuda_min_chunk))
            cuda_splits = 1 << (cuda_splits.bit_length() - 1)
    cuda_chunk = triton.cdiv(triton.cdiv(max(max_len, 1), cuda_splits), 32) * 32
    if cuda_side < 0:  # auto (v7): one side CTA per request where all CTAs are resident at once (2 per SM)
        sms = torch.cuda.get_device_properties(kv_indptr.device).multi_processor_count if kv_indptr.is_cuda else 132
        cuda_side = 1 if (cuda_splits + 1) * batch <= 2 * sms and side_indices.numel() else 0
    return DecodePlan(kv_indptr.to(torch.int32), kv_indices, side_indptr.to(torch.int32), side_indices,
                      num_splits, chunk, block_n, num_warps, num_stages, prefetch, cuda_int4=cuda_int4,
                      cuda_splits=cuda_splits, cuda_chunk=cuda_chunk, int4_tokens=kv_indices.numel(),
                      cuda_side_ctas=cuda_side)


_LAUNCHED: dict = {}  # specialisation key -> Triton CompiledKernel (see _launch_decode)
_FAST = [True]  # cleared (for good) if the direct launch ever rejects its arguments


def _launch_decode(grid, args, ptrs, constexprs, options, key):
    """Launch ``_decode_kernel``; after the first launch of a specialisation, straight through the compiled
    kernel's launcher. Triton's ``kernel[grid](...)`` re-binds and re-specialises all 32 arguments on every
    call, and its launcher asks the driver about every tensor argument (``cuPointerGetAttribute``): tens of
    microseconds of host time per launch, which bound the small decode shapes. The direct launch passes the
    pointers as integers (``ptrs``: device allocations, the same addresses the driver would return).
    ``key`` holds everything Triton specialises on (argument dtypes, constexprs, launch options, the integer
    argument ``chunk``'s divisibility); the caller passes a key only when every pointer is 16-byte aligned,
    which the first launch then also saw: the cached kernel is the one Triton would pick."""
    kernel = _LAUNCHED.get(key) if key is not None and _FAST[0] else None
    if kernel is not None and knobs.runtime.launch_enter_hook is None:
        try:
            stream = driver.active.get_current_stream(args[0].device.index)
            kernel.run(*grid, stream, kernel.function, kernel.packed_metadata, None, None, None, *ptrs(),
                       *args[len(args) - 3:], *constexprs.values())
            return
        except (TypeError, ValueError, AttributeError):  # the launcher's argument parsing: Triton's own path
            _LAUNCHED.clear()
            _FAST[0] = False
            key = None
    kernel = _decode_kernel[grid](*args, **constexprs, **options)
    if key is not None and _FAST[0] and kernel is not None and hasattr(kernel, "packed_metadata"):
        if list(constexprs) != _decode_kernel.arg_names[len(args):]:
            raise AssertionError("kv4_decode: constexprs out of the kernel's parameter order")
        _LAUNCHED[key] = kernel


def _cache_args(cache: KV4LayerCache, plan: DecodePlan) -> tuple:
    """The cache's 8 kernel arguments (meta as 32-bit words, contiguous), made once per (plan, layer)."""
    c = cache
    tensors = (c.k_codes, c.k_meta, c.v_codes, c.v_meta, c.k_side, c.k_side_scale, c.v_side, c.v_side_scale)
    key = ("cache", *map(id, tensors))  # the entry holds the tensors, so their ids stay unique
    hit = plan._host.get(key)
    if hit is None:
        k_w, v_w = meta_words(c.k_meta), meta_words(c.v_meta)
        t = tuple(x if x.is_contiguous() else x.contiguous()  # strides are compile-time constants of the kernel
                  for x in (c.k_codes, k_w, c.v_codes, v_w, c.k_side, c.k_side_scale, c.v_side, c.v_side_scale))
        off64 = c.k_codes.numel() > 2**31 or k_w.numel() > 2**31  # offsets < numel
        ptrs = tuple(x.data_ptr() for x in t)
        hit = plan._host[key] = (t, off64, all(p % 16 == 0 for p in ptrs), ptrs, tensors)
    return hit


def _workspace(plan: DecodePlan, bsz: int, hq: int, hkv: int, d: int, device) -> tuple:
    """Partial outputs / LSEs of the splits and a scratch LSE, shared by the layers of one step (launches on
    one stream run in order, and each launch consumes its partials before it ends)."""
    key = ("ws", bsz, hq, hkv, d, str(device))
    hit = plan._host.get(key)
    if hit is None:
        parts = plan.num_splits * plan.cuda_wgroups + max(1, plan.cuda_side_ctas)  # + the side region's part(s)
        ws = (torch.empty(bsz, hq, parts, d, dtype=torch.float32, device=device),
              torch.empty(bsz, hq, parts, dtype=torch.float32, device=device),
              torch.empty(bsz, hq, dtype=torch.float32, device=device),
              device_hadamard(d, device), ticket_counters(bsz * hkv, device))
        part_out, part_lse, lse, hmat, counters = ws
        # The counters buffer is kept here even if a later, larger batch replaces it in ``ticket_counters``:
        # it stays zero between launches (each merge resets its own counter).
        head = tuple(x.data_ptr() for x in (hmat, plan.kv_indptr, plan.kv_indices, plan.side_indptr,
                                            plan.side_indices))
        tail = tuple(x.data_ptr() for x in (part_out, part_lse, counters))
        hit = plan._host[key] = (*ws, head, tail, all(p % 16 == 0 for p in head + tail + (lse.data_ptr(),)))
    return hit


# Auto choice of the unfused CUDA INT4 kernel (two launches): from this many INT4 token-heads per step on (H200 table,
# v5 in NOTES.md). The fused kernel (one launch, ~24 us host time) is taken at every size (v6).
CUDA_AUTO_MIN_TOKEN_HEADS = 1 << 19


def _cuda_plan(plan: DecodePlan) -> DecodePlan:
    """The plan with the CUDA kernel's split layout (the Triton side/merge launch and the workspaces follow it)."""
    hit = plan._host.get("cuda_plan")
    if hit is None:
        import dataclasses

        hit = plan._host["cuda_plan"] = dataclasses.replace(plan, num_splits=plan.cuda_splits,
                                                            chunk=plan.cuda_chunk, cuda_int4=0)
    return hit


def cuda_options(plan: DecodePlan) -> dict:
    """The plan's CUDA kernel options, as ``decode_cuda.kernel`` / ``decode_cuda.variant`` take them."""
    return dict(min_blocks=plan.cuda_min_blocks, warps=plan.cuda_warps, pipe=plan.cuda_pipe, tma=plan.cuda_tma,
                fuse=plan.cuda_fuse, issue=plan.cuda_issue, early=plan.cuda_early, merge=plan.cuda_merge,
                side=plan.cuda_side_ctas, ablate=plan.cuda_ablate, wgroups=plan.cuda_wgroups, wside=plan.cuda_wside)


def _cuda_kernel(q: torch.Tensor, plan: DecodePlan, hkv: int, group: int, d: int, rotate: bool):
    """The CUDA INT4 kernel when the plan selects it and it runs here, else None (Triton kernel). Decided once
    per (plan, query dtype and device, shape)."""
    if plan.cuda_int4 == 0 or q.device.type != "cuda":
        return None
    key = ("cuda_fn", q.dtype, q.device.index, hkv, group, d)
    if key in plan._host:
        return plan._host[key]
    fn = None
    if plan.cuda_int4 > 0 or plan.cuda_fuse or plan.int4_tokens * hkv >= CUDA_AUTO_MIN_TOKEN_HEADS:
        from . import decode_cuda

        if decode_cuda.supported(q, hkv, group, d, plan.kv_indices):
            fn = decode_cuda.kernel(hkv, q.dtype, q.device, **cuda_options(plan))
    plan._host[key] = fn
    return fn


def kv4_decode(q: torch.Tensor, cache: KV4LayerCache, plan: DecodePlan, *, sm_scale: float | None = None,
               rotate: bool = True, return_lse: bool = False):
    """One decode step of one layer: ``q [B, Hq, D]`` -> ``out [B, Hq, D]`` (q's dtype, fp32
    for fp64 input); with ``return_lse`` also the natural-log LSE ``[B, Hq]``.
    Where the plan selects it (``cuda_int4``) and it is available, the CUDA kernel of ``decode_cuda.py`` runs the
    INT4 region, and with ``cuda_fuse`` (default) also the INT8 side region and the merge in the same launch;
    unfused, the Triton kernel adds the INT8 side region and merges (two launches)."""
    bsz, hq, d = q.shape
    hkv = cache.num_kv_heads
    if hq % hkv or d != cache.head_dim or bsz != plan.batch_size:
        raise ValueError(f"kv4_decode: q {tuple(q.shape)} does not fit cache Hkv={hkv}, D={cache.head_dim} "
                         f"and plan batch {plan.batch_size}")
    group = hq // hkv
    sm_scale = sm_scale if sm_scale is not None else d ** -0.5
    q = q.contiguous()
    cuda_fn = _cuda_kernel(q, plan, hkv, group, d, rotate)
    for cand in ((_cuda_plan(plan), plan) if cuda_fn is not None else (plan,)):
        t, off64, cache_aligned, cache_ptrs, _ = _cache_args(cache, cand)
        part_out, part_lse, lse_ws, hmat, counters, head, tail, plan_aligned = _workspace(cand, bsz, hq, hkv, d,
                                                                                          q.device)
        if cuda_fn is None or (cache_aligned and plan_aligned and q.data_ptr() % 16 == 0 and (
                not cuda_fn[4] or (t[4].dtype == torch.int8 and t[5].dtype == torch.float16
                                   and cand.side_indices.dtype == torch.int32))):
            break
        cuda_fn = None  # the CUDA kernel's vector loads need 16-byte aligned tensors: the Triton kernel instead
    plan = cand
    out_dtype = torch.float32 if q.dtype == torch.float64 else q.dtype
    out = torch.empty(bsz, hq, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device) if return_lse else lse_ws
    q_ptr = q.data_ptr()
    if cuda_fn is not None:
        lkey = ("cuda_launch", cache_ptrs, id(cuda_fn), sm_scale, rotate)
        launcher = plan._host.get(lkey)
        if launcher is None:
            from . import decode_cuda

            launcher = plan._host[lkey] = decode_cuda.Launcher(
                cuda_fn, (plan.num_splits + cuda_fn[5], bsz), hkv,
                (q_ptr, head[1], head[2], *cache_ptrs[:4], tail[0], tail[1], head[3], head[4], *cache_ptrs[4:],
                 tail[2], 0, 0), plan.chunk,
                plan.num_splits * cuda_fn[6] + cuda_fn[5] if cuda_fn[4] else plan.num_splits + 1, sm_scale * LOG2E,
                FP16_MAGIC, rotate)
        launcher(q_ptr, driver.active.get_current_stream(q.device.index), out.data_ptr(), lse.data_ptr())
        if cuda_fn[4]:  # fused: side region and merge done in the same launch
            return (out, lse / LOG2E) if return_lse else out
    asm = use_asm(q.device)
    args = (q, hmat, plan.kv_indptr, plan.kv_indices, plan.side_indptr, plan.side_indices, *t, part_out, part_lse,
            counters, out, lse, sm_scale * LOG2E, plan.chunk, FP16_MAGIC)
    constexprs = dict(  # in the kernel's parameter order (the direct launch passes them positionally)
        HKV=hkv, GROUP=group, BLOCK_H=max(plan.block_h, triton.next_power_of_2(group)), BLOCK_N=plan.block_n,
        HALF=d // 2, NUM_SPLITS=plan.num_splits, PREFETCH=plan.prefetch, USE_ASM=asm, OFF64=off64, ROTATE=rotate,
        SIDE_MERGE=cuda_fn is not None)
    options = dict(num_warps=plan.num_warps, num_stages=plan.num_stages,
                   **({"maxnreg": plan.max_registers} if plan.max_registers else {}))
    key = None
    if asm and cache_aligned and plan_aligned and q_ptr % 16 == 0:  # out and a fresh lse: new allocations
        key = (q.device.index, q.dtype, out_dtype, plan.kv_indices.dtype, plan.side_indices.dtype, plan.chunk % 16,
               plan.chunk == 1, *constexprs.values(), *options.items())
    _launch_decode((hkv, 1 if cuda_fn is not None else plan.num_splits + 1, bsz), args,
                   lambda: (q_ptr, *head, *cache_ptrs, *tail, out.data_ptr(), lse.data_ptr()),
                   constexprs, options, key)
    return (out, lse / LOG2E) if return_lse else out

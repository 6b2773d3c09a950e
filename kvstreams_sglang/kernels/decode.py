"""Decode kernel: split-KV (flash-decoding) attention over the INT4 region and the INT8
side region of a page-size-1 KV4 cache, merged exactly by log-sum-exp.

Shape of the API follows FlashInfer: ``plan_decode`` builds the per-step metadata once
(index lists and the split size), ``kv4_decode`` runs one layer. Grid ``(B, Hkv,
NUM_SPLITS + 1)``: programs ``split < NUM_SPLITS`` each stream one chunk of the request's
INT4 slots, the last program of a (request, head) reads its INT8 side slots; all write a
partial output and LSE, and ``_merge_kernel`` combines them. One program serves all
``GROUP = Hq / Hkv`` query heads of its KV head, so each KV byte is read once (GQA).

Why the arithmetic looks like this (KV4-RL): the query is INT8 (rotated into the keys'
Hadamard basis), keys are INT4 codes ``c`` with per-vector ``scale, offset``, so
``q.k ~ s_q (scale (q8 . c) + offset sum(q8))``: the dot is an exact integer dot on the
tensor cores and the affine correction is two FMAs per score. Values: ``P V =
(P * scale_v) c_v + (P . offset_v)``, an fp16 dot on codes plus a per-row sum; PV
accumulates in fp32. Reference: ``kv4.reference.decode_reference``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..kv4.cache import KV4LayerCache
from .quantize import kv4_quantize_query
from .tiles import int4_load, int4_math, int8_tile

LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    Q8, QScale, stride_qb, stride_qh, stride_sb,
    KvIndptr, KvIndices, SideIndptr, SideIndices,
    KCodes, KMeta, VCodes, VMeta, KSide, KSideScale, VSide, VSideScale,
    stride_cs, stride_ch, stride_ms, stride_mh, stride_ss, stride_sh, stride_scs, stride_sch,
    Out, Lse, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    sm_scale_log2, chunk,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, HALF: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    hrow = tl.arange(0, BLOCK_H)
    hmask = hrow < GROUP
    qh = hk * GROUP + hrow
    d = tl.arange(0, HALF)

    q_ptr = Q8 + b * stride_qb + qh[:, None] * stride_qh + d[None, :]
    q_lo = tl.load(q_ptr, mask=hmask[:, None], other=0)  # [BLOCK_H, HALF] int8
    q_hi = tl.load(q_ptr + HALF, mask=hmask[:, None], other=0)
    sq = tl.load(QScale + b * stride_sb + qh, mask=hmask, other=0.0).to(tl.float32)

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
        # Software pipeline over page-size-1 gathers (each tile's loads wait on its slot ids):
        # tile i's math runs while tile i+1's codes and tile i+2's slot ids are in flight.
        ar = tl.arange(0, BLOCK_N)
        nmask = lo + ar < hi
        slot = tl.load(KvIndices + start + lo + ar, mask=nmask, other=0).to(tl.int64)
        kc, k_scale, k_off, vc, v_scale, v_off = int4_load(slot, nmask, hk, KCodes, KMeta, VCodes, VMeta,
                                                           stride_cs, stride_ch, stride_ms, stride_mh, HALF)
        mask_next = lo + BLOCK_N + ar < hi
        slot_next = tl.load(KvIndices + start + lo + BLOCK_N + ar, mask=mask_next, other=0).to(tl.int64)
        for n0 in range(lo, hi, BLOCK_N):
            kc_n, k_scale_n, k_off_n, vc_n, v_scale_n, v_off_n = int4_load(
                slot_next, mask_next, hk, KCodes, KMeta, VCodes, VMeta, stride_cs, stride_ch, stride_ms, stride_mh,
                HALF)
            mask_after = n0 + 2 * BLOCK_N + ar < hi
            slot_after = tl.load(KvIndices + start + n0 + 2 * BLOCK_N + ar, mask=mask_after, other=0).to(tl.int64)
            m_i, l_i, acc_lo, acc_hi, acc_off = int4_math(
                q_lo, q_hi, qs, q_sum, m_i, l_i, acc_lo, acc_hi, acc_off, nmask, kc, k_scale, k_off, vc, v_scale,
                v_off)
            kc, k_scale, k_off, vc, v_scale, v_off = kc_n, k_scale_n, k_off_n, vc_n, v_scale_n, v_off_n
            nmask, mask_next, slot_next = mask_next, mask_after, slot_after
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
    denom = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(denom), float("-inf"))
    o_ptr = Out + b * stride_ob + qh[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_ptr, acc_lo / denom[:, None], mask=hmask[:, None])
    tl.store(o_ptr + HALF, acc_hi / denom[:, None], mask=hmask[:, None])
    tl.store(Lse + b * stride_lb + qh * stride_lh + split, lse, mask=hmask)


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
    num_stages: int = 2

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.numel() - 1


def plan_decode(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, side_indptr: torch.Tensor,
                side_indices: torch.Tensor, *, num_kv_heads: int, num_splits: int | None = None,
                block_n: int = 128, target_programs: int = 1024, num_warps: int = 4,
                num_stages: int = 1) -> DecodePlan:
    """Build the decode metadata once per step (one host sync for the longest INT4 list).

    ``num_splits`` defaults to enough splits to give ``target_programs`` programs (several
    waves on a 132-SM H200) without splits shorter than one tile, rounded down to a power of
    two: it is a compile-time constant of the kernel, and an engine whose batch and lengths
    change every step would otherwise compile a variant for each value. Launch defaults from
    the H200 sweep (bench/results/decode_sweep_h200.json: block 128, 4 warps, 1 stage).
    """
    lengths = kv_indptr[1:] - kv_indptr[:-1]
    max_len = int(lengths.max()) if lengths.numel() else 0
    batch = kv_indptr.numel() - 1
    if num_splits is None:
        want = max(1, math.ceil(target_programs / max(1, batch * num_kv_heads)))
        num_splits = max(1, min(want, triton.cdiv(max_len, block_n)))
        num_splits = 1 << (num_splits.bit_length() - 1)
    chunk = triton.cdiv(triton.cdiv(max(max_len, 1), num_splits), block_n) * block_n
    return DecodePlan(kv_indptr.to(torch.int32), kv_indices, side_indptr.to(torch.int32), side_indices,
                      num_splits, chunk, block_n, num_warps, num_stages)


def kv4_decode(q: torch.Tensor, cache: KV4LayerCache, plan: DecodePlan, *, sm_scale: float | None = None,
               rotate: bool = True, return_lse: bool = False):
    """One decode step of one layer: ``q [B, Hq, D]`` -> ``out [B, Hq, D]`` (q's dtype, fp32
    for fp64 input); with ``return_lse`` also the natural-log LSE ``[B, Hq]``."""
    bsz, hq, d = q.shape
    hkv = cache.num_kv_heads
    if hq % hkv or d != cache.head_dim or bsz != plan.batch_size:
        raise ValueError(f"kv4_decode: q {tuple(q.shape)} does not fit cache Hkv={hkv}, D={cache.head_dim} "
                         f"and plan batch {plan.batch_size}")
    group = hq // hkv
    sm_scale = sm_scale if sm_scale is not None else d ** -0.5
    q8 = kv4_quantize_query(q, rotate=rotate)  # [B, Hq, D] int8 + [B, Hq] fp16 scale
    codes, qscale = q8.codes.contiguous(), q8.scale.contiguous()
    parts = plan.num_splits + 1
    part_out = torch.empty(bsz, hq, parts, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(bsz, hq, parts, dtype=torch.float32, device=q.device)
    c = cache
    _decode_kernel[(bsz, hkv, parts)](
        codes, qscale, codes.stride(0), codes.stride(1), qscale.stride(0),
        plan.kv_indptr, plan.kv_indices, plan.side_indptr, plan.side_indices,
        c.k_codes, c.k_meta, c.v_codes, c.v_meta, c.k_side, c.k_side_scale, c.v_side, c.v_side_scale,
        c.k_codes.stride(0), c.k_codes.stride(1), c.k_meta.stride(0), c.k_meta.stride(1),
        c.k_side.stride(0), c.k_side.stride(1), c.k_side_scale.stride(0), c.k_side_scale.stride(1),
        part_out, part_lse, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        sm_scale * LOG2E, plan.chunk,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=plan.block_n, HALF=d // 2,
        NUM_SPLITS=plan.num_splits, num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    out_dtype = torch.float32 if q.dtype == torch.float64 else q.dtype
    out = torch.empty(bsz, hq, d, dtype=out_dtype, device=q.device)
    lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device)
    _merge_kernel[(bsz, hq)](
        part_out, part_lse, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out, lse, out.stride(0), out.stride(1), lse.stride(0),
        NUM_PARTS=parts, PARTS_P2=triton.next_power_of_2(parts), D=d,
    )
    return (out, lse / LOG2E) if return_lse else out

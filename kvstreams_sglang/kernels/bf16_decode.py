"""Full-precision (BF16) paged decode: the baseline the KV4 kernel is measured against,
and the engine's decode path for ``kv_dtype="bf16"`` on the GPU.

Same structure as ``decode.py`` (split-KV over a CSR list of page-size-1 slots, one
program per (request, KV head, split) serving all GQA heads of that KV head, exact LSE
merge), reading ``[num_slots, Hkv, D]`` K/V in the model dtype. Reference:
``kv4.reference.full_precision_attention`` on the gathered slots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .decode import LOG2E, DecodePlan, _merge_kernel


@triton.jit
def _bf16_decode_kernel(
    Q, stride_qb, stride_qh, KvIndptr, KvIndices, K, V, stride_ks, stride_kh,
    Out, Lse, stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    sm_scale_log2, chunk,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    hrow = tl.arange(0, BLOCK_H)
    hmask = hrow < GROUP
    qh = hk * GROUP + hrow
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qb + qh[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)

    start = tl.load(KvIndptr + b)
    length = tl.load(KvIndptr + b + 1) - start
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nmask = n < hi
        slot = tl.load(KvIndices + start + n, mask=nmask, other=0).to(tl.int64)
        ptr = slot[:, None] * stride_ks + hk * stride_kh + d[None, :]
        k = tl.load(K + ptr, mask=nmask[:, None], other=0.0)
        v = tl.load(V + ptr, mask=nmask[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * sm_scale_log2
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    denom = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(denom), float("-inf"))
    tl.store(Out + b * stride_ob + qh[:, None] * stride_oh + split * stride_os + d[None, :], acc / denom[:, None],
             mask=hmask[:, None])
    tl.store(Lse + b * stride_lb + qh * stride_lh + split, lse, mask=hmask)


def bf16_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, plan: DecodePlan, *,
                sm_scale: float | None = None) -> torch.Tensor:
    """``q [B, Hq, D]`` over ``k_pool, v_pool [S, Hkv, D]`` at the plan's INT4-list slots
    (here: all kept slots; the plan's side lists are ignored) -> ``out [B, Hq, D]``."""
    if plan.splits.chunk <= 0:
        raise ValueError("bf16_decode: needs an eager plan (one split size for all requests)")
    bsz, hq, d = q.shape
    hkv = k_pool.shape[1]
    group = hq // hkv
    sm_scale = sm_scale if sm_scale is not None else d ** -0.5
    q = q.to(k_pool.dtype)
    parts = plan.splits.num
    part_out = torch.empty(bsz, hq, parts, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(bsz, hq, parts, dtype=torch.float32, device=q.device)
    _bf16_decode_kernel[(bsz, hkv, parts)](
        q, q.stride(0), q.stride(1), plan.kv_indptr, plan.kv_indices, k_pool, v_pool, k_pool.stride(0),
        k_pool.stride(1), part_out, part_lse, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), sm_scale * LOG2E, plan.splits.chunk,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=plan.triton.block_n, D=d,
        DOT_PREC="ieee" if k_pool.dtype == torch.float32 else "tf32",
        num_warps=plan.triton.num_warps, num_stages=plan.triton.num_stages,
    )
    out = torch.empty(bsz, hq, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(bsz, hq, dtype=torch.float32, device=q.device)
    _merge_kernel[(bsz, hq)](
        part_out, part_lse, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out, lse, out.stride(0), out.stride(1), lse.stride(0),
        NUM_PARTS=parts, PARTS_P2=triton.next_power_of_2(parts), D=d,
    )
    return out

"""Readable torch references for every KV4 kernel (store, decode, extend).

Each Triton kernel in ``kvstreams_sglang.kernels`` computes exactly these functions;
every kernel test compares against them. Arithmetic mirrors the kernels: the query is
rotated and quantised to INT8, scores on the INT4 region are
``s_q * (scale_k * (q8 . c) + offset_k * sum(q8))`` (an integer dot, then fp32), scores on
the INT8 region ``s_q * s_k * (q8 . k8)``; each region yields an output and a
log-sum-exp, merged exactly (``merge_states``). Accumulation is fp32 (or float64 when
the query is float64, for studies).
"""

from __future__ import annotations

import math

import torch

from .cache import KV4LayerCache
from .hadamard import hadamard
from .quant import Int4Tensor, Int8Tensor, pack_int4, quantize_int4, quantize_int8


def quantize_query(q: torch.Tensor, *, rotate: bool) -> Int8Tensor:
    """Rotate (same Hadamard basis as the keys) then INT8-quantise each query head."""
    qf = q.float() if q.dtype != torch.float64 else q
    return quantize_int8(hadamard(qf) if rotate else qf)


def store_reference(cache: KV4LayerCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                    side_slots: torch.Tensor | None = None, *, rotate: bool = True) -> None:
    """Quantise ``k, v [N, Hkv, D]`` into INT4 slots ``slots [N]`` and, where
    ``side_slots[i] >= 0``, into INT8 side slots. Keys are Hadamard-rotated first."""
    kf = k.float()
    kf = hadamard(kf) if rotate else kf
    k4, v4 = quantize_int4(kf), quantize_int4(v.float())
    cache.k_codes[slots] = k4.codes
    cache.k_meta[slots] = torch.stack((k4.scale, k4.offset), -1)
    cache.v_codes[slots] = v4.codes
    cache.v_meta[slots] = torch.stack((v4.scale, v4.offset), -1)
    if side_slots is None:
        return
    sel = side_slots >= 0
    if sel.any():
        k8, v8 = quantize_int8(kf[sel]), quantize_int8(v.float()[sel])
        cache.k_side[side_slots[sel]] = k8.codes
        cache.k_side_scale[side_slots[sel]] = k8.scale
        cache.v_side[side_slots[sel]] = v8.codes
        cache.v_side_scale[side_slots[sel]] = v8.scale


def _acc_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _expand_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    """``[N, Hkv, ...] -> [Hq, N, ...]`` (GQA: query head h reads KV head h // group)."""
    return x.transpose(0, 1).repeat_interleave(group, dim=0)


def int4_region_attention(q8: Int8Tensor, k: Int4Tensor, v: Int4Tensor, sm_scale: float,
                          acc: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One query row per head ``q8 [Hq, D]`` over INT4 keys/values ``[N, Hkv, D]``.

    Returns ``(out [Hq, D], lse [Hq])``; ``lse = -inf`` and ``out = 0`` when ``N = 0``.
    """
    hq, d = q8.codes.shape
    group = hq // k.shape[1]
    qc = q8.codes.to(acc)  # [Hq, D]
    sq = q8.scale.to(acc)  # [Hq]
    kc = _expand_heads(k.unpack_codes(), group).to(acc)  # [Hq, N, D]
    ks, ko = _expand_heads(k.scale, group).to(acc), _expand_heads(k.offset, group).to(acc)  # [Hq, N]
    dot = torch.einsum("hd,hnd->hn", qc, kc)  # exact integers
    scores = sq[:, None] * (ks * dot + ko * qc.sum(-1, keepdim=True)) * sm_scale
    vals = _expand_heads(v.unpack_codes(), group).to(acc) * _expand_heads(v.scale, group).to(acc)[..., None]
    vals = vals + _expand_heads(v.offset, group).to(acc)[..., None]
    return _softmax_region(scores, vals)


def int8_region_attention(q8: Int8Tensor, k: Int8Tensor, v: Int8Tensor, sm_scale: float,
                          acc: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``int4_region_attention`` over the INT8 side cache: ``s_q * s_k * (q8 . k8)``."""
    hq = q8.codes.shape[0]
    group = hq // k.shape[1]
    qc, sq = q8.codes.to(acc), q8.scale.to(acc)
    kc = _expand_heads(k.codes, group).to(acc)
    ks = _expand_heads(k.scale, group).to(acc)
    scores = sq[:, None] * ks * torch.einsum("hd,hnd->hn", qc, kc) * sm_scale
    vals = _expand_heads(v.codes, group).to(acc) * _expand_heads(v.scale, group).to(acc)[..., None]
    return _softmax_region(scores, vals)


def full_precision_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                             visible: torch.Tensor | None = None,
                             acc: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [M, Hq, D]`` over unquantised ``k, v [N, Hkv, D]``; ``visible [M, N]`` masks keys.

    Returns ``(out [M, Hq, D], lse [M, Hq])``.
    """
    group = q.shape[1] // k.shape[1]
    kk, vv = _expand_heads(k.to(acc), group), _expand_heads(v.to(acc), group)  # [Hq, N, D]
    scores = torch.einsum("mhd,hnd->mhn", q.to(acc), kk) * sm_scale
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [M, Hq]
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    out = torch.einsum("mhn,hnd->mhd", torch.exp(scores - safe[..., None]), vv)
    return out, lse


def _softmax_region(scores: torch.Tensor, vals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # scores [Hq, N], vals [Hq, N, D]
    if scores.shape[-1] == 0:
        return vals.new_zeros(vals.shape[0], vals.shape[-1]), scores.new_full(scores.shape[:1], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hn,hnd->hd", torch.exp(scores - lse[:, None]), vals)
    return out, lse


def merge_states(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax merge of attention over disjoint key sets: ``out = sum_i w_i out_i``,
    ``w_i = exp(lse_i - lse)``, ``lse = logsumexp_i lse_i``. Empty sets carry ``lse = -inf``."""
    lse_all = torch.stack(lses, 0)
    lse = torch.logsumexp(lse_all, 0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(lse_all - safe[None])  # exp(-inf) = 0 for empty regions
    out = sum(w[i][..., None] * outs[i] for i in range(len(outs)))
    return out, lse


def _ranges(indptr: torch.Tensor, i: int) -> slice:
    return slice(int(indptr[i]), int(indptr[i + 1]))


def decode_reference(q: torch.Tensor, cache: KV4LayerCache, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     side_indptr: torch.Tensor, side_indices: torch.Tensor, *, sm_scale: float | None = None,
                     rotate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched decode: ``q [B, Hq, D]``; request ``b`` attends to INT4 slots
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` and INT8 side slots likewise.

    Returns ``(out [B, Hq, D], lse [B, Hq])`` in the accumulation dtype.
    """
    acc = _acc_dtype(q)
    sm_scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
    outs, lses = [], []
    for b in range(q.shape[0]):
        q8 = quantize_query(q[b], rotate=rotate)
        slots, side = kv_indices[_ranges(kv_indptr, b)].long(), side_indices[_ranges(side_indptr, b)].long()
        o4, l4 = int4_region_attention(q8, cache.int4_k(slots), cache.int4_v(slots), sm_scale, acc)
        o8, l8 = int8_region_attention(q8, cache.int8_k(side), cache.int8_v(side), sm_scale, acc)
        o, lse = merge_states([o4, o8], [l4, l8])
        outs.append(o)
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def extend_reference(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qo_indptr: torch.Tensor,
                     cache: KV4LayerCache, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     side_indptr: torch.Tensor, side_indices: torch.Tensor, *, sm_scale: float | None = None,
                     rotate: bool = True) -> torch.Tensor:
    """Extend/prefill: request ``b``'s new tokens ``q[qo_indptr[b]:qo_indptr[b+1]]`` attend
    to its quantised cached prefix (INT4 and INT8 regions, INT8 query) and, in full
    precision, causally to the new tokens ``k_new, v_new`` of the same request.

    Returns ``out [N_new, Hq, D]`` in the accumulation dtype.
    """
    acc = _acc_dtype(q)
    sm_scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
    out = torch.empty(q.shape, dtype=acc, device=q.device)
    for b in range(qo_indptr.numel() - 1):
        rows = _ranges(qo_indptr, b)
        qb, n = q[rows], rows.stop - rows.start
        if n == 0:
            continue
        slots, side = kv_indices[_ranges(kv_indptr, b)].long(), side_indices[_ranges(side_indptr, b)].long()
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        o_new, l_new = full_precision_attention(qb, k_new[rows], v_new[rows], sm_scale, causal, acc)
        for t in range(n):
            q8 = quantize_query(qb[t], rotate=rotate)
            o4, l4 = int4_region_attention(q8, cache.int4_k(slots), cache.int4_v(slots), sm_scale, acc)
            o8, l8 = int8_region_attention(q8, cache.int8_k(side), cache.int8_v(side), sm_scale, acc)
            out[rows.start + t] = merge_states([o4, o8, o_new[t]], [l4, l8, l_new[t]])[0]
    return out


__all__ = [
    "decode_reference", "extend_reference", "full_precision_attention", "int4_region_attention",
    "int8_region_attention", "merge_states", "pack_int4", "quantize_query", "store_reference",
]

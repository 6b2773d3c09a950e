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


def _per_key(x: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``[..., N, Hkv] -> [..., Hkv, 1, N]``: a per-key factor broadcast over the query heads of a group."""
    return x.to(acc).movedim(-1, -2)[..., None, :]


def _region_attention(q8: Int8Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, k_offset: torch.Tensor | None,
                      v_codes: torch.Tensor, v_scale: torch.Tensor, v_offset: torch.Tensor | None, sm_scale: float,
                      acc: torch.dtype, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared by both regions. ``q8 [..., Hq, D]``; codes ``[..., N, Hkv, D]`` (leading dims
    broadcast against the query's), per-vector ``scale``/``offset [..., N, Hkv]`` (no offset:
    symmetric INT8). Query head ``h`` reads KV head ``h // (Hq / Hkv)`` (GQA)."""
    *lead, hq, d = q8.codes.shape
    hkv = k_codes.shape[-2]
    qc = q8.codes.to(acc).reshape(*lead, hkv, hq // hkv, d)  # [..., Hkv, G, D]
    sq = q8.scale.to(acc).reshape(*lead, hkv, hq // hkv, 1)  # [..., Hkv, G, 1]
    dot = qc @ k_codes.to(acc).movedim(-3, -1)  # [..., Hkv, G, N], exact integers
    scores = _per_key(k_scale, acc) * dot
    if k_offset is not None:  # INT4 keys are affine: k = scale * c + offset
        scores = scores + _per_key(k_offset, acc) * qc.sum(-1, keepdim=True)
    scores = sq * scores * sm_scale
    if valid is not None:  # [..., N]
        scores = scores.masked_fill(~valid[..., None, None, :], -math.inf)
    lse = torch.logsumexp(scores, dim=-1)  # [..., Hkv, G]; -inf for an empty region
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - safe[..., None])  # [..., Hkv, G, N]
    # P V = (P * scale_v) c_v + P . offset_v, as the kernels compute it
    out = (p * _per_key(v_scale, acc)) @ v_codes.to(acc).movedim(-3, -2)  # [..., Hkv, G, D]
    if v_offset is not None:
        out = out + (p * _per_key(v_offset, acc)).sum(-1, keepdim=True)
    return out.reshape(*lead, hq, d), lse.reshape(*lead, hq)


def int4_region_attention(q8: Int8Tensor, k: Int4Tensor, v: Int4Tensor, sm_scale: float,
                          acc: torch.dtype = torch.float32,
                          valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows ``q8 [..., Hq, D]`` (one per head) over INT4 keys/values ``[..., N, Hkv, D]``
    (leading dims broadcast: ``[N, Hkv, D]`` for one sequence, ``[B, N, Hkv, D]`` with a
    ``valid [B, N]`` padding mask for a batch): scores ``s_q * (scale_k * (q8 . c) +
    offset_k * sum(q8))``, values ``scale_v * c + offset_v``.

    Returns ``(out [..., Hq, D], lse [..., Hq])``; ``lse = -inf`` and ``out = 0`` when ``N = 0``.
    """
    return _region_attention(q8, k.unpack_codes(), k.scale, k.offset, v.unpack_codes(), v.scale, v.offset,
                             sm_scale, acc, valid)


def int8_region_attention(q8: Int8Tensor, k: Int8Tensor, v: Int8Tensor, sm_scale: float,
                          acc: torch.dtype = torch.float32,
                          valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``int4_region_attention`` over the INT8 side cache: ``s_q * s_k * (q8 . k8)``."""
    return _region_attention(q8, k.codes, k.scale, None, v.codes, v.scale, None, sm_scale, acc, valid)


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


def _padded(indptr: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR lists -> ``(slots [B, L], valid [B, L])``, each row padded (with slot 0) to the longest."""
    start, lengths = indptr[:-1].long(), (indptr[1:] - indptr[:-1]).long()
    col = torch.arange(int(lengths.max()) if lengths.numel() else 0, device=indptr.device)
    valid = col[None] < lengths[:, None]
    if not valid.any():
        return torch.zeros(valid.shape, dtype=torch.long, device=indptr.device), valid
    return indices.long()[torch.where(valid, start[:, None] + col[None], 0)], valid


def decode_reference(q: torch.Tensor, cache: KV4LayerCache, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                     side_indptr: torch.Tensor, side_indices: torch.Tensor, *, sm_scale: float | None = None,
                     rotate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched decode: ``q [B, Hq, D]``; request ``b`` attends to INT4 slots
    ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` and INT8 side slots likewise.

    Returns ``(out [B, Hq, D], lse [B, Hq])`` in the accumulation dtype.
    """
    acc = _acc_dtype(q)
    sm_scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
    q8 = quantize_query(q, rotate=rotate)  # [B, Hq, D]
    slots, valid = _padded(kv_indptr, kv_indices)  # [B, L4]
    o4, l4 = int4_region_attention(q8, cache.int4_k(slots), cache.int4_v(slots), sm_scale, acc, valid)
    side, side_valid = _padded(side_indptr, side_indices)  # [B, L8]
    o8, l8 = int8_region_attention(q8, cache.int8_k(side), cache.int8_v(side), sm_scale, acc, side_valid)
    return merge_states([o4, o8], [l4, l8])


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
        q8 = quantize_query(qb, rotate=rotate)  # [n, Hq, D]: every new token's query at once
        o4, l4 = int4_region_attention(q8, cache.int4_k(slots), cache.int4_v(slots), sm_scale, acc)
        o8, l8 = int8_region_attention(q8, cache.int8_k(side), cache.int8_v(side), sm_scale, acc)
        out[rows] = merge_states([o4, o8, o_new], [l4, l8, l_new])[0]
    return out


__all__ = [
    "decode_reference", "extend_reference", "full_precision_attention", "int4_region_attention",
    "int8_region_attention", "merge_states", "pack_int4", "quantize_query", "store_reference",
]

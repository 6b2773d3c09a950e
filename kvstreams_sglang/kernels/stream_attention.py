"""Batch-invariant stream attention: one kernel for the sampler's steps and the trainer's replay.

Why: with batch-invariant matmuls (``batch_invariant.py``) the only op left whose rounding depends
on the call is attention: the sampler attends one new token over its stream's kept slots, the
trainer one query among thousands under the eviction mask, with different kernels, block splits
and softmax maxima. Here both run the same program, and a query's result depends only on the keys
it sees: keys are walked in blocks of ``BLOCK_N`` *positions* (block ``b`` holds positions
``[b*BLOCK_N, (b+1)*BLOCK_N)``, wherever the key is stored), every query row keeps its own
online-softmax state, and a key a row cannot see (evicted, in the future, another record, never
stored) enters as ``p = 0`` exactly. A block with nothing visible then leaves the state bit for
bit unchanged (so a block no row of the tile sees is skipped: the cost follows the live keys), and
the sampler (which holds only the kept keys) and the trainer (which holds every key and masks)
reach the same bits. With the matmuls invariant too, the trainer's bf16 logprobs
equal the sampler's (``bench/trainer_parity.py --batch-invariant``).

Queries are tiled as ``BLOCK_Q`` consecutive tokens of one sequence x the ``GROUP`` query heads
of one KV head (``BLOCK_Q * GROUP >= 16`` rows for the MMA), the same tile on both sides.
Reference: ``stream_attention_reference`` (float64).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .batch_invariant import interpreted, invariant_dot, launch_guard
from .decode import LOG2E

BLOCK_N, NUM_WARPS, MIN_ROWS = 64, 4, 16
NO_DEATH = torch.iinfo(torch.int32).max


@triton.jit
def _stream_attention_kernel(
    Q, stride_qt, stride_qh, K, V, stride_kr, stride_kh, stride_vr, stride_vh, Out, stride_ot, stride_oh,
    TileSeq, TileTok, TileCnt, QPos, QRow, KeyRows, stride_map, map_len, Death, sm_scale_log2,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    HAS_DEATH: tl.constexpr, EMULATE: tl.constexpr,
):
    tile = tl.program_id(0)
    hk = tl.program_id(1)
    seq = tl.load(TileSeq + tile)
    tok0 = tl.load(TileTok + tile)
    cnt = tl.load(TileCnt + tile)
    r = tl.arange(0, BLOCK_Q * GROUP)
    tok = tok0 + r // GROUP
    rvalid = r // GROUP < cnt
    head = hk * GROUP + r % GROUP
    d = tl.arange(0, D)
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=rvalid[:, None],
                other=0.0)
    qpos = tl.load(QPos + tok, mask=rvalid, other=-1)
    if HAS_DEATH:
        qrow = tl.load(QRow + tok, mask=rvalid, other=0)
    m_i = tl.full([BLOCK_Q * GROUP], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP, D], tl.float32)
    last = tl.minimum(tl.max(qpos, 0) + 1, map_len)
    for n0 in range(0, last, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        krow = tl.load(KeyRows + seq * stride_map + pos, mask=pos < last, other=-1)
        kmask = krow >= 0
        krow = tl.where(kmask, krow, 0).to(tl.int64)
        vis = kmask[None, :] & (pos[None, :] <= qpos[:, None])
        if HAS_DEATH:
            death = tl.load(Death + krow, mask=kmask, other=0)
            vis = vis & (qrow[:, None] < death[None, :])
        # A block no row of the tile sees would leave every row's state bit for bit unchanged: skip its K/V.
        if tl.max(tl.max(vis.to(tl.int32), 1), 0) > 0:
            kv = kmask[:, None]
            k = tl.load(K + krow[:, None] * stride_kr + hk * stride_kh + d[None, :], mask=kv, other=0.0)
            v = tl.load(V + krow[:, None] * stride_vr + hk * stride_vh + d[None, :], mask=kv, other=0.0)
            s = invariant_dot(q, tl.trans(k), EMULATE) * sm_scale_log2
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: p = 0, state stays 0
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + invariant_dot(p.to(v.dtype), v, EMULATE)
            m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=rvalid[:, None])


@dataclass(frozen=True)
class StreamAttentionPlan:
    """Where every query and key is: ``key_rows[s, p]`` is the storage row of sequence ``s``'s key
    at position ``p`` (-1: none), ``q_pos`` each query token's position; with ``death``
    (trainer), key row ``k`` is hidden from query rows ``>= death[k]`` (``q_rows``: each query's
    own row in the same coordinates)."""

    tile_seq: torch.Tensor  # [tiles] int32
    tile_tok: torch.Tensor  # [tiles] int32 first query token of the tile
    tile_cnt: torch.Tensor  # [tiles] int32 query tokens in the tile (<= block_q)
    q_pos: torch.Tensor  # [Nq] int32
    key_rows: torch.Tensor  # [S, P] int32
    block_q: int
    q_rows: torch.Tensor | None = None  # [Nq] int32
    death: torch.Tensor | None = None  # [R] int32


def block_q_for(gqa_group: int) -> int:
    if gqa_group & (gqa_group - 1):
        raise ValueError(f"stream attention needs a power-of-two GQA group, got {gqa_group}")
    return max(1, MIN_ROWS // gqa_group)


def plan_stream_attention(q_starts: torch.Tensor, q_counts: torch.Tensor, q_pos: torch.Tensor,
                          key_rows: torch.Tensor, *, gqa_group: int, q_rows: torch.Tensor | None = None,
                          death: torch.Tensor | None = None) -> StreamAttentionPlan:
    """Sequence ``s`` has query tokens ``[q_starts[s], q_starts[s] + q_counts[s])`` (rows of ``q``);
    they are tiled ``block_q`` at a time, never across sequences."""
    bq = block_q_for(gqa_group)
    dev = q_pos.device
    counts = q_counts.long()
    tiles = (counts + bq - 1) // bq
    seq = torch.repeat_interleave(torch.arange(len(counts), device=dev), tiles)
    first = torch.cumsum(tiles, 0) - tiles
    j = torch.arange(len(seq), device=dev) - first[seq]
    tok = q_starts.long()[seq] + j * bq
    cnt = torch.clamp(counts[seq] - j * bq, max=bq)
    i32 = torch.int32
    return StreamAttentionPlan(seq.to(i32), tok.to(i32), cnt.to(i32), q_pos.to(i32), key_rows.to(i32), bq,
                               None if q_rows is None else q_rows.to(i32),
                               None if death is None else death.clamp(max=NO_DEATH).to(i32))


def key_row_map(num_seqs: int, seq_of: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``[num_seqs, max_pos + 1]`` int32 map (sequence, position) -> storage row, -1 elsewhere.
    Positions must be unique within a sequence (a KV stream's are strictly increasing)."""
    width = int(pos.max()) + 1 if pos.numel() else 1
    out = torch.full((num_seqs, width), -1, dtype=torch.int32, device=pos.device)
    out[seq_of.long(), pos.long()] = rows.to(torch.int32)
    if int((out >= 0).sum()) != pos.numel():
        raise ValueError("stream attention: two keys of one sequence share a position")
    return out


def stream_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StreamAttentionPlan, *,
                     sm_scale: float) -> torch.Tensor:
    """``q [Nq, Hq, D]`` over keys/values stored as ``k, v [R, Hkv, D]`` (any row/head strides,
    contiguous last dims) -> ``out [Nq, Hq, D]`` in ``q``'s dtype."""
    nq, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv or k.shape != v.shape or k.shape[2] != d or q.stride(-1) != 1 or k.stride(-1) != 1 \
            or v.stride(-1) != 1:
        raise ValueError(f"stream_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                         "(needs Hq % Hkv == 0, k and v of one shape, contiguous last dims)")
    group = hq // hkv
    out = torch.empty(nq, hq, d, dtype=q.dtype, device=q.device)
    if nq == 0 or plan.tile_seq.numel() == 0:
        return out
    km = plan.key_rows
    has_death = plan.death is not None
    with launch_guard():
        _stream_attention_kernel[(plan.tile_seq.numel(), hkv)](
            q, q.stride(0), q.stride(1), k, v, k.stride(0), k.stride(1), v.stride(0), v.stride(1), out, out.stride(0),
            out.stride(1),
            plan.tile_seq, plan.tile_tok, plan.tile_cnt, plan.q_pos, plan.q_rows if has_death else plan.q_pos,
            km, km.stride(0), km.shape[1], plan.death if has_death else km, sm_scale * LOG2E,
            GROUP=group, BLOCK_Q=plan.block_q, BLOCK_N=BLOCK_N, D=d, HAS_DEATH=has_death,
            EMULATE=interpreted(), num_warps=NUM_WARPS,
        )
    return out


def stream_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: StreamAttentionPlan, *,
                               sm_scale: float) -> torch.Tensor:
    """The same attention in float64 from the plan, query by query (tests)."""
    nq, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.zeros(nq, hq, d, dtype=torch.float64)
    for s_idx, t0, c in zip(plan.tile_seq.tolist(), plan.tile_tok.tolist(), plan.tile_cnt.tolist(), strict=True):
        rows_of = plan.key_rows[s_idx].long()
        for t in range(t0, t0 + c):
            p = int(plan.q_pos[t])
            keys = rows_of[: p + 1]
            keys = keys[keys >= 0]
            if plan.death is not None:
                keys = keys[plan.death[keys].long() > int(plan.q_rows[t])]
            kk = k[keys].double().repeat_interleave(group, 1)  # [n, Hq, D]
            vv = v[keys].double().repeat_interleave(group, 1)
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[t].double(), kk) * sm_scale, -1)
            out[t] = torch.einsum("hn,nhd->hd", w, vv)
    return out

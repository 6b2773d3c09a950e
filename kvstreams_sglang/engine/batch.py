"""One forward step's metadata: which tokens run, where their KV goes, what they see.

Built once per step (FlashInfer's ``plan``), read by every layer's attention. A step is
either *extend* (each stream computes all its pending tokens: prompts, appended
observations, the last sampled token) or *decode* (each stream computes exactly one
token, the one it just sampled). Each new token gets position = its stream index.

Everything is derived on the device from the ``SlotTable`` rows (which already hold
the new tokens' slots when the batch is built): no per-token Python work per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from ..streams import KV4Pool, KVStream, SlotTable


@dataclass
class StepItem:
    """One stream's share of a step: its pending tokens and the slots they will occupy."""

    stream: KVStream
    num_new: int
    slots: list[int]


@dataclass
class ForwardBatch:
    mode: Literal["extend", "decode"]
    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    out_slots: torch.Tensor  # [N] slots the new tokens' KV is written to
    qo_indptr: torch.Tensor  # [B+1] new tokens of stream b: [qo_indptr[b], qo_indptr[b+1])
    logits_indices: torch.Tensor  # [B] last new token of each stream (the one that samples)
    # Full-precision attention: each stream's kept slots (new ones included), padded to [B, L].
    kv_gather: torch.Tensor | None = None  # [B, L]
    attn_mask: torch.Tensor | None = None  # [B, 1, M, L] bool
    q_gather: torch.Tensor | None = None  # [B, M] index into the N new tokens
    q_valid: torch.Tensor | None = None  # [B, M]
    kv_indptr: torch.Tensor | None = None  # [B+1] CSR over all kept slots (paged full-precision decode)
    kv_indices: torch.Tensor | None = None
    # KV4 attention: side slots of new tokens and the CSR lists of both regions.
    side_slots: torch.Tensor | None = None  # [N], -1 = no INT8 copy
    kv4: dict = field(default_factory=dict)  # kv_indptr, kv_indices, side_indptr, side_indices
    decode_plan: object | None = None

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1


@dataclass
class _Rows:
    rows: torch.Tensor  # [B]
    slots: torch.Tensor  # [B, L] int32
    positions: torch.Tensor  # [B, L] int32
    valid_after: torch.Tensor  # [B, L] kept + new
    valid_before: torch.Tensor  # [B, L] kept prefix only
    computed_before: torch.Tensor  # [B]
    num_new: torch.Tensor  # [B]


def _common(items: list[StepItem], mode, table: SlotTable, device) -> tuple[ForwardBatch, _Rows]:
    ids, slots, n_new, before, prefix, rows = [], [], [], [], [], []
    for it in items:
        st = it.stream
        ids.extend(st.token_ids[st.num_computed:st.num_computed + it.num_new])
        slots.extend(it.slots)
        n_new.append(it.num_new)
        before.append(st.num_computed)
        prefix.append(len(st.slots))
        rows.append(st.row)
    lens_after = [p + n for p, n in zip(prefix, n_new, strict=True)]
    as_long = dict(dtype=torch.long, device=device)
    n_new_t = torch.tensor(n_new, **as_long)
    before_t = torch.tensor(before, **as_long)
    qo = torch.zeros(len(items) + 1, dtype=torch.int32, device=device)
    qo[1:] = torch.cumsum(n_new_t, 0)
    stream_of = torch.repeat_interleave(torch.arange(len(items), device=device), n_new_t)  # [N]
    positions = before_t[stream_of] + torch.arange(stream_of.numel(), device=device) - qo[:-1].long()[stream_of]
    fb = ForwardBatch(mode=mode, input_ids=torch.tensor(ids, **as_long), positions=positions,
                      out_slots=torch.tensor(slots, **as_long), qo_indptr=qo, logits_indices=(qo[1:] - 1).long())
    rows_t = torch.tensor(rows, **as_long)
    width = max(lens_after)
    col = torch.arange(width, device=device)[None]
    r = _Rows(rows=rows_t, slots=table.slots[rows_t, :width], positions=table.positions[rows_t, :width].long(),
              valid_after=col < torch.tensor(lens_after, **as_long)[:, None],
              valid_before=col < torch.tensor(prefix, **as_long)[:, None], computed_before=before_t, num_new=n_new_t)
    return fb, r


def _csr(select: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major selection of ``values [B, L]`` where ``select`` -> (indptr [B+1], indices)."""
    indptr = torch.zeros(select.shape[0] + 1, dtype=torch.int32, device=select.device)
    indptr[1:] = torch.cumsum(select.sum(1), 0)
    return indptr, values[select].to(torch.int32)


def build_full_precision_batch(items: list[StepItem], mode, table: SlotTable, device) -> ForwardBatch:
    """Stream b's new token at position p sees every kept token of b at a position <= p."""
    fb, r = _common(items, mode, table, device)
    max_m = max(it.num_new for it in items)
    m = torch.arange(max_m, device=device)[None]  # [1, M]
    q_valid = m < r.num_new[:, None]
    q_pos = r.computed_before[:, None] + m  # [B, M]
    fb.kv_gather = r.slots.long()
    fb.attn_mask = (r.valid_after[:, None, :] & (r.positions[:, None, :] <= q_pos[:, :, None]))[:, None]
    fb.q_gather = torch.where(q_valid, fb.qo_indptr[:-1].long()[:, None] + m, 0)
    fb.q_valid = q_valid
    fb.kv_indptr, fb.kv_indices = _csr(r.valid_after, r.slots)
    return fb


def build_kv4_batch(items: list[StepItem], mode, table: SlotTable, pool: KV4Pool, device) -> ForwardBatch:
    """Region lists per stream. Extend attends to the prefix as cached *before* the step
    (new tokens see each other in full precision, then are stored); decode stores the
    new token first and attends to everything, itself included."""
    fb, r = _common(items, mode, table, device)
    sink, recent = pool.sink, pool.recent

    def side_slot(rows, pos):
        ring = sink + pos % recent if recent else torch.full_like(pos, -1)
        slot = rows * (sink + recent) + torch.where(pos < sink, pos, ring)
        return torch.where((pos < sink) | (recent > 0), slot, -1)

    end_after = r.computed_before + r.num_new  # [B]
    stream_of = torch.repeat_interleave(torch.arange(len(items), device=device), r.num_new)
    p_new = fb.positions
    keep8 = (p_new < sink) | (p_new >= end_after[stream_of] - recent)  # the last `recent` written this step
    fb.side_slots = torch.where(keep8, side_slot(r.rows[stream_of], p_new), -1)

    valid, end = (r.valid_after, end_after) if mode == "decode" else (r.valid_before, r.computed_before)
    protected = valid & ((r.positions < sink) | (r.positions >= end[:, None] - recent))
    kv_indptr, kv_indices = _csr(valid & ~protected, r.slots)
    side_indptr, side_indices = _csr(protected, side_slot(r.rows[:, None], r.positions))
    fb.kv4 = dict(kv_indptr=kv_indptr, kv_indices=kv_indices, side_indptr=side_indptr, side_indices=side_indices)
    return fb

"""One forward step's metadata: which tokens run, where their KV goes, what they see.

Built once per step (FlashInfer's ``plan``), read by every layer's attention. A step is
either *extend* (each stream computes all its pending tokens: prompts, appended
observations, the last sampled token) or *decode* (each stream computes exactly one
token, the one it just sampled). Each new token gets position = its stream index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from ..kv4.regions import protected_mask
from ..streams import KV4Pool, KVStream


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
    # Full-precision attention: per stream, kept prefix slots then new slots, padded to [B, L].
    kv_gather: torch.Tensor | None = None  # [B, L]
    attn_mask: torch.Tensor | None = None  # [B, 1, M, L] bool
    q_gather: torch.Tensor | None = None  # [B, M] index into the N new tokens
    q_valid: torch.Tensor | None = None  # [B, M]
    # KV4 attention: side slots of new tokens and the CSR lists of both regions.
    side_slots: torch.Tensor | None = None  # [N], -1 = no INT8 copy
    kv4: dict = field(default_factory=dict)  # kv_indptr, kv_indices, side_indptr, side_indices
    decode_plan: object | None = None

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1


def _common(items: list[StepItem], mode, device) -> ForwardBatch:
    ids, pos, slots, indptr = [], [], [], [0]
    for it in items:
        st = it.stream
        ids.extend(st.token_ids[st.num_computed:st.num_computed + it.num_new])
        pos.extend(range(st.num_computed, st.num_computed + it.num_new))
        slots.extend(it.slots)
        indptr.append(indptr[-1] + it.num_new)
    as_long = dict(dtype=torch.long, device=device)
    qo = torch.tensor(indptr, dtype=torch.int32, device=device)
    return ForwardBatch(mode=mode, input_ids=torch.tensor(ids, **as_long), positions=torch.tensor(pos, **as_long),
                        out_slots=torch.tensor(slots, **as_long), qo_indptr=qo,
                        logits_indices=(qo[1:] - 1).long())


def build_full_precision_batch(items: list[StepItem], mode, device) -> ForwardBatch:
    """Padded gather indices and masks: stream b's queries see its kept prefix and,
    causally, its new tokens."""
    fb = _common(items, mode, device)
    bsz = len(items)
    lens = [len(it.stream.slots) + it.num_new for it in items]
    max_l, max_m = max(lens), max(it.num_new for it in items)
    gather = torch.zeros(bsz, max_l, dtype=torch.long)
    valid = torch.zeros(bsz, max_l, dtype=torch.bool)
    q_gather = torch.zeros(bsz, max_m, dtype=torch.long)
    q_valid = torch.zeros(bsz, max_m, dtype=torch.bool)
    key_new_idx = torch.full((bsz, max_l), -1, dtype=torch.long)  # index among new tokens, -1 for prefix
    for b, it in enumerate(items):
        n_prefix = len(it.stream.slots)
        gather[b, :lens[b]] = torch.tensor(it.stream.slots + it.slots, dtype=torch.long)
        valid[b, :lens[b]] = True
        key_new_idx[b, n_prefix:lens[b]] = torch.arange(it.num_new)
        start = int(fb.qo_indptr[b])
        q_gather[b, :it.num_new] = torch.arange(start, start + it.num_new)
        q_valid[b, :it.num_new] = True
    m = torch.arange(max_m)[None, :, None]  # [1, M, 1]
    k_new = key_new_idx[:, None, :]  # [B, 1, L]
    mask = valid[:, None, :] & ((k_new < 0) | (k_new <= m))  # [B, M, L]
    fb.kv_gather, fb.attn_mask = gather.to(device), mask[:, None].to(device)
    fb.q_gather, fb.q_valid = q_gather.to(device), q_valid.to(device)
    return fb


def build_kv4_batch(items: list[StepItem], mode, pool: KV4Pool, device) -> ForwardBatch:
    """Region lists per stream. Extend attends to the prefix as cached *before* the step
    (new tokens see each other in full precision, then are stored); decode stores the
    new token first and attends to everything, itself included."""
    fb = _common(items, mode, device)
    kv_ptr, side_ptr, kv_idx, side_idx, new_side = [0], [0], [], [], []
    for it in items:
        st = it.stream
        new_pos = list(range(st.num_computed, st.num_computed + it.num_new))
        end_after = st.num_computed + it.num_new
        # INT8 copies: sinks, and the last `recent` positions written in this step.
        new_side.extend(pool.side_slot(st.row, p) if (p < pool.sink or p >= end_after - pool.recent) else -1
                        for p in new_pos)
        if mode == "decode":
            slots, positions, end = st.slots + it.slots, st.positions + new_pos, end_after
        else:
            slots, positions, end = st.slots, st.positions, st.num_computed
        pos_t = torch.tensor(positions, dtype=torch.long)
        prot = protected_mask(pos_t, end, sink=pool.sink, recent=pool.recent)
        slots_t = torch.tensor(slots, dtype=torch.long)
        kv_idx.append(slots_t[~prot])
        side_idx.append(torch.tensor([pool.side_slot(st.row, int(p)) for p in pos_t[prot]], dtype=torch.long))
        kv_ptr.append(kv_ptr[-1] + int((~prot).sum()))
        side_ptr.append(side_ptr[-1] + int(prot.sum()))
    i32 = dict(dtype=torch.int32, device=device)
    fb.side_slots = torch.tensor(new_side, dtype=torch.long, device=device)
    fb.kv4 = dict(kv_indptr=torch.tensor(kv_ptr, **i32), kv_indices=torch.cat(kv_idx).to(**i32),
                  side_indptr=torch.tensor(side_ptr, **i32), side_indices=torch.cat(side_idx).to(**i32))
    return fb

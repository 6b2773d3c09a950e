"""One forward step's metadata: which tokens run, where their KV goes, what they see.

Built once per step (FlashInfer's ``plan``), read by every layer's attention. A step is
either *extend* (each stream computes all its pending tokens: prompts, appended
observations, the last sampled token) or *decode* (each stream computes exactly one
token, the one it just sampled). Each new token gets position = its stream index.

Everything is derived on the device from the ``SlotTable`` rows (which already hold
the new tokens' slots when the batch is built): no per-token Python work per step.

``ReplayBatch`` is the odd one out: the metadata of a re-prefill under new weights
(``Engine.reprefill``), which replays whole streams with the trainer's mask instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.nn.attention.flex_attention import BlockMask

from trainer_masks import PackedBatch, StreamRecord, flex_block_mask, pack
from trainer_masks.scoring.invariant import packed_plan
from trainer_masks.scoring.logprobs import HF_ATTENTION, resolve_impl

from ..kernels.stream_attention import StreamAttentionPlan, key_row_map, plan_stream_attention
from ..kv4.regions import csr, new_side_slots, region_lists
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
    max_new_tokens: int | None = None  # the longest stream's new tokens (host: kernel grids need no sync)
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
    invariant_plan: StreamAttentionPlan | None = None  # batch-invariant attention (bf16 KV)

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
        ids.extend(st.ledger.token_ids[st.ledger.num_computed:st.ledger.num_computed + it.num_new])
        slots.extend(it.slots)
        n_new.append(it.num_new)
        before.append(st.ledger.num_computed)
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
                      out_slots=torch.tensor(slots, **as_long), qo_indptr=qo, logits_indices=(qo[1:] - 1).long(),
                      max_new_tokens=max(n_new))
    rows_t = torch.tensor(rows, **as_long)
    width = max(lens_after)
    col = torch.arange(width, device=device)[None]
    r = _Rows(rows=rows_t, slots=table.slots[rows_t, :width], positions=table.positions[rows_t, :width].long(),
              valid_after=col < torch.tensor(lens_after, **as_long)[:, None],
              valid_before=col < torch.tensor(prefix, **as_long)[:, None], computed_before=before_t, num_new=n_new_t)
    return fb, r


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
    fb.kv_indptr, fb.kv_indices = csr(r.valid_after, r.slots)
    return fb


def build_invariant_batch(items: list[StepItem], mode, table: SlotTable, device, *, gqa_group: int) -> ForwardBatch:
    """Batch-invariant attention: each stream's kept slots (new ones included) by position, the
    same map the trainer builds from its records (``kernels.stream_attention``)."""
    fb, r = _common(items, mode, table, device)
    stream = torch.arange(len(items), device=device)[:, None].expand_as(r.valid_after)[r.valid_after]
    key_rows = key_row_map(len(items), stream, r.positions[r.valid_after], r.slots[r.valid_after])
    fb.invariant_plan = plan_stream_attention(fb.qo_indptr[:-1], r.num_new, fb.positions, key_rows, gqa_group=gqa_group)
    return fb


def build_kv4_batch(items: list[StepItem], mode, table: SlotTable, pool: KV4Pool, device) -> ForwardBatch:
    """Region lists per stream. Extend attends to the prefix as cached *before* the step
    (new tokens see each other in full precision, then are stored); decode stores the
    new token first and attends to everything, itself included."""
    fb, r = _common(items, mode, table, device)
    sink, recent = pool.sink, pool.recent
    end_after = r.computed_before + r.num_new  # [B]
    stream_of = torch.repeat_interleave(torch.arange(len(items), device=device), r.num_new)
    fb.side_slots = new_side_slots(r.rows[stream_of], fb.positions, end_after[stream_of], sink=sink, recent=recent)
    valid, end = (r.valid_after, end_after) if mode == "decode" else (r.valid_before, r.computed_before)
    fb.kv4 = region_lists(r.rows, r.slots, r.positions, valid, end, sink=sink, recent=recent)
    return fb


# ---- re-prefill under new weights (``Engine.reprefill``) ----


@dataclass
class ReplayBatch:
    """One re-prefill forward: streams' computed tokens (evicted ones included) packed into one
    row at their original positions under the trainer's eviction mask, plus where the K/V of
    the rows whose KV is still resident goes (their existing slots)."""

    packed: PackedBatch  # on the device; input_ids / position_ids [1, N]
    mask: torch.Tensor | BlockMask | None  # dense bool [1, 1, N, N] (SDPA) or a FlexAttention BlockMask
    attention: Literal["sdpa", "flex_attention", "kvstreams_invariant"]  # the HF attention function
    live_rows: torch.Tensor  # [L] rows of the pack whose KV is resident
    live_slots: torch.Tensor  # [L] their slots
    side_slots: torch.Tensor | None = None  # [L] KV4 only: INT8 side slot, -1 = none
    stream_plan: StreamAttentionPlan | None = None  # impl="invariant": the stream-attention plan (mask is None)

    @property
    def num_tokens(self) -> int:
        return len(self.packed)


def computed_record(stream: KVStream) -> StreamRecord:
    """The stream's ``StreamRecord`` cut to its computed tokens ``[0, num_computed)``: what the
    trainer replays for them (pending tokens have no KV yet and stay pending)."""
    n = stream.ledger.num_computed
    rec = stream.ledger.to_record()
    return StreamRecord(token_ids=rec.token_ids[:n], positions=rec.positions[:n], sources=rec.sources[:n],
                        loss_mask=rec.loss_mask[:n], logprobs=rec.logprobs[:n],
                        policy_versions=rec.policy_versions[:n], evictions=rec.evictions)


def build_replay_batch(streams: list[KVStream], device, *, impl="auto", pool=None, gqa_group: int = 1) -> ReplayBatch:
    """Pack ``streams`` (each with computed tokens) for one masked forward, exactly as
    ``trainer_masks.score_streams`` packs their records (same mask rule ``k <= q < death[k]``,
    SDPA + dense mask on CPU, FlexAttention on CUDA). ``pool``: a ``KV4Pool`` to also compute
    each live token's INT8 side slot with the store rule (kept ``p < sink`` or
    ``p >= num_computed - recent``). ``impl="invariant"``: the batch-invariant stream attention
    (``gqa_group``: query heads per KV head), no mask."""
    device = torch.device(device)
    impl = resolve_impl(impl, device)
    packed = pack([computed_record(st) for st in streams]).to(device)
    plan = packed_plan(packed, gqa_group) if impl == "invariant" else None
    mask = None if plan is not None else flex_block_mask(packed, device) if impl == "flex" \
        else packed.dense_mask()[None, None]
    as_long = dict(dtype=torch.long, device=device)
    rows, slots, positions, ends, stream_rows = [], [], [], [], []
    for st, off in zip(streams, packed.offsets, strict=True):
        rows.extend(off + p for p in st.positions)
        slots.extend(st.slots)
        positions.extend(st.positions)
        ends.extend([st.ledger.num_computed] * len(st.positions))
        stream_rows.extend([st.row] * len(st.positions))
    batch = ReplayBatch(packed=packed, mask=mask, attention=HF_ATTENTION[impl], live_rows=torch.tensor(rows, **as_long),
                        live_slots=torch.tensor(slots, **as_long), stream_plan=plan)
    if isinstance(pool, KV4Pool):
        sink, recent = pool.sink, pool.recent
        pos, end, row = (torch.tensor(x, **as_long) for x in (positions, ends, stream_rows))
        batch.side_slots = new_side_slots(row, pos, end, sink=sink, recent=recent)
    return batch

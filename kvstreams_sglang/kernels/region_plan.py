"""The region lists of a step (``kv4.regions.region_lists``) in two kernels, read straight from the row table.

Why: every kv4rl step is planned on the host before its launch (under CUDA graphs, before the replay). The torch
form gathers each request's row ``[B, W]``, looks its slots' positions up, splits them by the protection rule and
compacts both regions into CSR lists: ~75 small ops, each a launch. A rollout on an H100 spent ~1.8 ms of the
scheduler's host time per decode step there (py-spy: 7.3% of the scheduler), against decode steps of ~8 ms, and the
GPU sat idle ~20% of the window. Here one program per request walks its row twice: once to count its INT4 and INT8
entries, then (after a cumsum gives the offsets) to write them, ranks from a cumsum inside each block. Same lists,
same order, no host sync: ``capacity`` bounds the lists as ``region_lists``' does.

A request ``b`` holds the first ``lengths[b]`` slots of row ``rows[b]`` of ``req_to_token``; a slot's logical
position is ``slot_positions[slot]``; ``ends[b]`` is the request's next position (decode: the new token's position
+ 1; extend: its first new token's position). The rule is ``regions.protected_mask``'s: INT8 iff ``p < sink`` or
``p >= end - recent``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv4.cache import ring_size, side_width

BLOCK = 256


@triton.jit
def _walk(req_to_token, stride_row, slot_positions, row, start, n, end, sink, recent, BLOCK: tl.constexpr):
    offs = start + tl.arange(0, BLOCK)
    inside = offs < n
    slot = tl.load(req_to_token + row * stride_row + offs, mask=inside, other=0)
    pos = tl.load(slot_positions + slot, mask=inside, other=0)
    protected = (pos < sink) | (pos >= end - recent)
    return slot, pos, inside & protected, inside & ~protected


@triton.jit(do_not_specialize=("num_req",))  # the batch size: one compile for any (Triton specialises 1 and 16k)
def _count_kernel(rows, lengths, ends, req_to_token, stride_row, slot_positions, counts, num_req, sink, recent,
                  BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(rows + b).to(tl.int64)
    n = tl.load(lengths + b)
    end = tl.load(ends + b)
    c4 = tl.full([], 0, tl.int32)
    c8 = tl.full([], 0, tl.int32)
    for start in range(0, n, BLOCK):
        _, _, int8, int4 = _walk(req_to_token, stride_row, slot_positions, row, start, n, end, sink, recent, BLOCK)
        c4 += tl.sum(int4.to(tl.int32), axis=0)
        c8 += tl.sum(int8.to(tl.int32), axis=0)
    tl.store(counts + b, c4)
    tl.store(counts + num_req + b, c8)


# the indptrs are rows of one [2, B + 1] buffer: the second's alignment follows the batch size (one compile for any)
@triton.jit(do_not_specialize_on_alignment=("kv_indptr", "side_indptr"))
def _write_kernel(rows, lengths, ends, req_to_token, stride_row, slot_positions, kv_indptr, side_indptr, kv_indices,
                  side_indices, sink, recent, ring, width, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    row = tl.load(rows + b).to(tl.int64)
    n = tl.load(lengths + b)
    end = tl.load(ends + b)
    at4 = tl.load(kv_indptr + b)
    at8 = tl.load(side_indptr + b)
    for start in range(0, n, BLOCK):
        slot, pos, int8, int4 = _walk(req_to_token, stride_row, slot_positions, row, start, n, end, sink, recent,
                                      BLOCK)
        i4 = int4.to(tl.int32)
        i8 = int8.to(tl.int32)
        tl.store(kv_indices + at4 + tl.cumsum(i4, axis=0) - 1, slot.to(tl.int32), mask=int4)
        side = row * width + tl.where(pos < sink, pos, sink + pos % ring)
        tl.store(side_indices + at8 + tl.cumsum(i8, axis=0) - 1, side.to(tl.int32), mask=int8)
        at4 += tl.sum(i4, axis=0)
        at8 += tl.sum(i8, axis=0)


def planned_region_lists(rows: torch.Tensor, lengths: torch.Tensor, ends: torch.Tensor, req_to_token: torch.Tensor,
                         slot_positions: torch.Tensor, *, sink: int, recent: int, capacity: int | None = None,
                         out: tuple[torch.Tensor, ...] | None = None) -> dict[str, torch.Tensor]:
    """``region_lists(rows, req_to_token[rows, :W], slot_positions[...], col < lengths[:, None], ends, ...)`` for
    any ``W >= lengths.max()``, in two launches. ``capacity``: a host bound of ``lengths.sum()`` (the lists are
    that long, entries past their ``indptr[-1]`` unspecified; the side list ``min(capacity, B * (sink +
    recent))``); None: the exact lengths, read with one host sync. ``out``: (kv_indptr [B + 1], kv_indices,
    side_indptr [B + 1], side_indices) to write instead, the index lists long enough for ``lengths.sum()`` and
    ``B * (sink + recent)`` entries (a CUDA graph's static buffers: no host sync, no allocation that depends on
    the batch's contents)."""
    if req_to_token.stride(1) != 1:
        raise ValueError("planned_region_lists: req_to_token rows must be contiguous")
    dev = req_to_token.device
    b = rows.numel()
    counts = torch.empty(2 * b, dtype=torch.int32, device=dev)
    indptr = torch.zeros(2, b + 1, dtype=torch.int32, device=dev)
    if b:
        _count_kernel[(b,)](rows, lengths, ends, req_to_token, req_to_token.stride(0), slot_positions, counts, b,
                            sink, recent, BLOCK=BLOCK)
        torch.cumsum(counts.view(2, b), 1, dtype=torch.int32, out=indptr[:, 1:])
    if out is not None:
        kv_indptr, kv_indices, side_indptr, side_indices = out
        kv_indptr.copy_(indptr[0])
        side_indptr.copy_(indptr[1])
    else:
        if capacity is None:
            n4, n8 = (int(x) for x in indptr[:, -1].tolist())
        else:
            n4, n8 = capacity, min(capacity, b * (sink + recent))
        kv_indptr, side_indptr = indptr[0], indptr[1]
        kv_indices = torch.zeros(n4, dtype=torch.int32, device=dev)
        side_indices = torch.zeros(n8, dtype=torch.int32, device=dev)
    if b:
        ring = max(ring_size(recent), 1)  # (no recent window: only sinks are protected, the ring is never read)
        _write_kernel[(b,)](rows, lengths, ends, req_to_token, req_to_token.stride(0), slot_positions, indptr[0],
                            indptr[1], kv_indices, side_indices, sink, recent, ring, side_width(sink, recent),
                            BLOCK=BLOCK)
    return dict(kv_indptr=kv_indptr, kv_indices=kv_indices, side_indptr=side_indptr, side_indices=side_indices)

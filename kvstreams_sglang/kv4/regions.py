"""Which cached positions are attended through INT8 and which through INT4.

The rule, shared by the engine, the SGLang backend and ``single_decode``: a kept
logical position ``p`` of a sequence whose next position is ``end`` is *protected*
(INT8 side cache) iff ``p < sink`` (attention sinks) or ``p >= end - recent`` (the most
recent window, counted in logical positions, evicted ones included). Every other kept
position is attended through its INT4 entry. So each kept position is in exactly one
region, and eviction needs no rewrite: an evicted position vanishes from both lists.
"""

from __future__ import annotations

import torch

from .cache import ring_size, side_width


def protected_mask(positions: torch.Tensor, end, *, sink: int, recent: int) -> torch.Tensor:
    """Boolean mask over ``positions`` (kept logical positions): True = INT8 region. ``end``: the
    sequence's next position (an int, or a tensor broadcasting against ``positions``). The one
    definition of the rule; everything else calls it."""
    return (positions < sink) | (positions >= end - recent)


def split_regions(length: int, *, sink: int, recent: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions ``0..length-1`` of an uncompacted sequence -> (INT4 positions, INT8 positions)."""
    pos = torch.arange(length)
    prot = protected_mask(pos, length, sink=sink, recent=recent)
    return pos[~prot], pos[prot]


def side_slots_of(rows: torch.Tensor, positions: torch.Tensor, *, sink: int, recent: int) -> torch.Tensor:
    """Vector form of ``cache.side_slot``: INT8 side slot of ``positions`` in sequence ``rows``
    (broadcast), -1 where a position has none (``recent == 0`` and not a sink)."""
    ring = sink + positions % ring_size(recent) if recent else torch.full_like(positions, -1)
    slot = rows * side_width(sink, recent) + torch.where(positions < sink, positions, ring)
    return torch.where((positions < sink) | (recent > 0), slot, -1)


def csr(select: torch.Tensor, values: torch.Tensor, *,
        capacity: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major selection of ``values [B, L]`` where ``select`` -> (indptr [B+1], indices int32).

    ``capacity`` (a host-known upper bound of the number selected): no host sync (a boolean
    index needs the count on the host first); ``indices`` then has ``capacity`` entries, the
    same as without it up to ``indptr[-1]`` and unspecified after. A CUDA graph's planner
    copies a length it knows without asking the device."""
    indptr = torch.zeros(select.shape[0] + 1, dtype=torch.int32, device=select.device)
    indptr[1:] = torch.cumsum(select.sum(1), 0)
    if capacity is None:
        return indptr, values[select].to(torch.int32)
    flat = select.reshape(-1)
    rank = torch.cumsum(flat, 0) - 1  # each selected entry's place in the row-major list
    dest = torch.where(flat, rank, capacity)  # the others land on one scratch entry past the end
    indices = torch.zeros(capacity + 1, dtype=torch.int32, device=select.device)
    indices.scatter_(0, dest, values.reshape(-1).to(torch.int32))
    return indptr, indices[:capacity]


def region_lists(rows: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                 end: torch.Tensor, *, sink: int, recent: int, capacity: int | None = None) -> dict[str, torch.Tensor]:
    """The per-sequence CSR lists the KV4 kernels read. Sequence ``b`` (row ``rows[b]``) holds
    ``slots[b, :]`` at logical ``positions[b, :]`` where ``valid``; ``end[b]`` is its next
    position. Returns ``kv_indptr/kv_indices`` (INT4 slots) and ``side_indptr/side_indices``
    (INT8 side slots of the protected positions). ``capacity``: a host-known bound of
    ``valid.sum()``, for lists built without a host sync (``csr``)."""
    protected = valid & protected_mask(positions, end[:, None], sink=sink, recent=recent)
    side_capacity = None if capacity is None else min(capacity, valid.shape[0] * (sink + recent))
    kv_indptr, kv_indices = csr(valid & ~protected, slots, capacity=capacity)
    side_indptr, side_indices = csr(protected, side_slots_of(rows[:, None], positions, sink=sink, recent=recent),
                                    capacity=side_capacity)
    return dict(kv_indptr=kv_indptr, kv_indices=kv_indices, side_indptr=side_indptr, side_indices=side_indices)


def row_region_lists(rows: torch.Tensor, lengths: torch.Tensor, ends: torch.Tensor, req_to_token: torch.Tensor,
                     slot_positions: torch.Tensor, *, width: int, sink: int, recent: int,
                     capacity: int | None = None) -> dict[str, torch.Tensor]:
    """``region_lists`` of requests holding the first ``lengths`` slots (at most ``width``) of their ``rows`` of a
    row table, each slot's logical position in ``slot_positions``; ``ends``: their next positions. The torch form
    of ``kernels.region_plan.planned_region_lists`` (the same lists)."""
    slots = req_to_token[rows, :width]  # [B, W]
    kept = slot_positions[slots.long()].long()  # [B, W] logical positions (rows get compacted)
    valid = torch.arange(width, device=rows.device)[None] < lengths[:, None]
    return region_lists(rows, slots, kept, valid, ends, sink=sink, recent=recent, capacity=capacity)


def new_side_slots(rows: torch.Tensor, positions: torch.Tensor, end_after: torch.Tensor, *, sink: int,
                   recent: int) -> torch.Tensor:
    """Where newly computed tokens (``positions`` of sequences ``rows``, which end at
    ``end_after`` after this step; all ``[N]``) write their INT8 copy, -1 = none: sinks and
    the last ``recent`` positions written this step."""
    keep8 = protected_mask(positions, end_after, sink=sink, recent=recent)
    return torch.where(keep8, side_slots_of(rows, positions, sink=sink, recent=recent), -1)

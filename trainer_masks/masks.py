"""The eviction mask: which keys each query saw when the stream was sampled.

One rule, written once in ``visible``: key ``k`` is visible to query ``q`` iff both belong to the
same document (record) of a packed batch and ``k <= q < death[k]``. The dense ``[N, N]`` mask (for
SDPA and for tests) and FlexAttention's ``mask_mod`` (for long packs on GPU) both evaluate it, so
they cannot drift apart.

Packing concatenates records into one row (``[1, N]``) as in packed SFT: each record keeps its own
positions, and ``death`` is shifted into packed coordinates (a record's "never" becomes its end).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from .record import StreamRecord

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def visible(document_ids: torch.Tensor, death: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """The trainer's attention rule on (broadcastable) query and key indices; pure tensor ops, so
    it vmaps inside FlexAttention and broadcasts for the dense mask. (Packed ``death`` alone already
    hides other records, since a record's keys die at its end; the document test states it.)"""
    return (document_ids[q] == document_ids[kv]) & (kv <= q) & (q < death[kv])


@dataclass(frozen=True)
class PackedBatch:
    """Records concatenated into one sequence, with what the mask and the loss need."""

    input_ids: torch.Tensor  # [1, N] long
    position_ids: torch.Tensor  # [1, N] long, each record's own positions
    document_ids: torch.Tensor  # [N] long, record index of each token
    death: torch.Tensor  # [N] long, packed index of the first query that no longer sees the key
    loss_mask: torch.Tensor  # [N] bool
    offsets: tuple[int, ...]  # start of each record in the pack
    lengths: tuple[int, ...]  # tokens of each record

    def __len__(self) -> int:
        return self.input_ids.shape[1]

    def dense_mask(self) -> torch.Tensor:
        """``[N, N]`` bool, True where query row ``q`` attends key column ``k``."""
        idx = torch.arange(len(self), device=self.death.device)
        return visible(self.document_ids, self.death, idx[:, None], idx[None, :])

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Cut a per-token tensor ``[N, ...]`` back into one piece per record."""
        return list(torch.split(values, list(self.lengths)))

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(
            input_ids=self.input_ids.to(device),
            position_ids=self.position_ids.to(device),
            document_ids=self.document_ids.to(device),
            death=self.death.to(device),
            loss_mask=self.loss_mask.to(device),
            offsets=self.offsets,
            lengths=self.lengths,
        )


def pack(records: Sequence[StreamRecord]) -> PackedBatch:
    """Concatenate ``records`` (in order) into one packed sequence on the CPU."""
    if not records or any(len(r) == 0 for r in records):
        raise ValueError("pack needs at least one record and no empty records")
    lengths = tuple(len(r) for r in records)
    offsets = tuple(sum(lengths[:i]) for i in range(len(records)))
    return PackedBatch(
        input_ids=torch.tensor([t for r in records for t in r.token_ids]).unsqueeze(0),
        position_ids=torch.tensor([p for r in records for p in r.positions]).unsqueeze(0),
        document_ids=torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]),
        death=torch.tensor([off + d for off, r in zip(offsets, records, strict=True) for d in r.death()]),
        loss_mask=torch.tensor([m for r in records for m in r.loss_mask], dtype=torch.bool),
        offsets=offsets,
        lengths=lengths,
    )


def dense_mask(record: StreamRecord) -> torch.Tensor:
    """``[T, T]`` bool mask of one record: True where query row ``q`` attends key column ``k``."""
    return pack([record]).dense_mask()


def flex_mask_mod(document_ids: torch.Tensor, death: torch.Tensor) -> MaskMod:
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` for a packed batch; the tensors it closes
    over must live on the device the attention runs on."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return visible(document_ids, death, q_idx, kv_idx)

    return mask_mod


def flex_block_mask(
    packed: PackedBatch, device: torch.device | str, block_size: int = 128, *, compile: bool = False
) -> BlockMask:
    """The packed batch's mask as a FlexAttention ``BlockMask`` on ``device``.

    Blocks of keys that no query of a block sees (other documents, keys evicted long ago) are
    skipped by the kernel, so cost follows the live context, not ``N**2``. Without ``compile`` the
    block mask is built from a materialised ``[N, N]`` mask; ``compile=True`` runs
    ``create_block_mask`` under ``torch.compile``, which avoids that for long packs.
    """
    mask_mod = flex_mask_mod(packed.document_ids.to(device), packed.death.to(device))
    build = torch.compile(create_block_mask) if compile else create_block_mask
    n = len(packed)
    return build(mask_mod, None, None, n, n, device=device, BLOCK_SIZE=block_size)

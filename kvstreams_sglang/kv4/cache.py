"""Memory layout of the KV4-RL cache for one attention layer (page size 1).

Slot-major, like SGLang's ``MHATokenToKVPool``: a token slot holds every KV head, so a
slot index is all a stream needs to find a token, and evicting a token frees one slot.

INT4 region (every cached token has an INT4 entry)::

    k_codes, v_codes  [num_slots, Hkv, D/2]  uint8   split-half packed (see quant.py)
    k_meta,  v_meta   [num_slots, Hkv, 2]    fp16    (scale, offset) side by side

One token-head costs 64 B of codes + 4 B of meta = 68 B per K or V against 256 B in BF16.
Codes rows are 64 B (16-byte aligned) so a kernel gathers them with wide loads; scale and
offset share a 4 B word so both arrive with one load, and the meta words of all heads of
a slot share a 32 B sector that neighbouring head-programs reuse from L2.

INT8 side cache (only protected positions: the first ``sink`` and most recent
``recent`` logical positions of each sequence)::

    k_side, v_side              [num_side_slots, Hkv, D]  int8
    k_side_scale, v_side_scale  [num_side_slots, Hkv]     fp16

Side slots are addressed per sequence row: row ``r`` owns ``w = side_width(sink, recent) = sink +
recent + 1`` consecutive side slots; position ``p < sink`` lives at ``r*w + p`` and a recent
position at ``r*w + sink + p % (recent + 1)`` (a ring with one spare slot). A position that slides
out of the recent window is simply no longer listed for the INT8 region; its ring slot is reused by
a newer token and its INT4 entry, written when it was cached, is used instead. The spare slot: a
token written at ``p`` overwrites ``p - recent - 1``, never ``p - recent``, which a later step that
computes ``p`` again still reads from INT8. That happens under SGLang's overlap scheduler, which
runs one more decode step of a finished turn; the stream drops that step's token and its next
turn recomputes it (``sglang_ext.stream_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant import Int4Tensor, Int8Tensor


@dataclass
class KV4LayerCache:
    k_codes: torch.Tensor  # [S, Hkv, D/2] uint8
    k_meta: torch.Tensor  # [S, Hkv, 2] fp16
    v_codes: torch.Tensor
    v_meta: torch.Tensor
    k_side: torch.Tensor  # [S8, Hkv, D] int8
    k_side_scale: torch.Tensor  # [S8, Hkv] fp16
    v_side: torch.Tensor
    v_side_scale: torch.Tensor

    @classmethod
    def empty(cls, num_slots: int, num_side_slots: int, num_kv_heads: int, head_dim: int,
              device=None) -> KV4LayerCache:
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for INT4 packing, got {head_dim}")
        s, s8, h, d = num_slots, num_side_slots, num_kv_heads, head_dim
        u8 = dict(dtype=torch.uint8, device=device)
        f16 = dict(dtype=torch.float16, device=device)
        i8 = dict(dtype=torch.int8, device=device)
        return cls(
            k_codes=torch.zeros(s, h, d // 2, **u8), k_meta=torch.zeros(s, h, 2, **f16),
            v_codes=torch.zeros(s, h, d // 2, **u8), v_meta=torch.zeros(s, h, 2, **f16),
            k_side=torch.zeros(s8, h, d, **i8), k_side_scale=torch.zeros(s8, h, **f16),
            v_side=torch.zeros(s8, h, d, **i8), v_side_scale=torch.zeros(s8, h, **f16),
        )

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[1]

    @property
    def head_dim(self) -> int:
        return 2 * self.k_codes.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in vars(self).values())

    def int4_k(self, slots: torch.Tensor) -> Int4Tensor:
        return Int4Tensor(self.k_codes[slots], self.k_meta[slots][..., 0], self.k_meta[slots][..., 1])

    def int4_v(self, slots: torch.Tensor) -> Int4Tensor:
        return Int4Tensor(self.v_codes[slots], self.v_meta[slots][..., 0], self.v_meta[slots][..., 1])

    def int8_k(self, side_slots: torch.Tensor) -> Int8Tensor:
        return Int8Tensor(self.k_side[side_slots], self.k_side_scale[side_slots])

    def int8_v(self, side_slots: torch.Tensor) -> Int8Tensor:
        return Int8Tensor(self.v_side[side_slots], self.v_side_scale[side_slots])


def int4_bytes_per_vector(head_dim: int) -> int:
    """Bytes one token-head K (or V) vector occupies in the INT4 region: 4-bit codes + fp16 scale and offset."""
    return head_dim // 2 + 4


def int8_bytes_per_vector(head_dim: int) -> int:
    """Bytes one token-head K (or V) vector occupies in the INT8 side cache: 8-bit codes + an fp16 scale."""
    return head_dim + 2


def ring_size(recent: int) -> int:
    """Side slots of the recent window's ring: ``recent`` and a spare (module docstring); 0 without a window."""
    return recent + 1 if recent else 0


def side_width(sink: int, recent: int) -> int:
    """Side slots per sequence row: the sinks' and the ring's."""
    return sink + ring_size(recent)


def side_slot(row: int, position: int, *, sink: int, recent: int) -> int:
    """INT8 side slot of a protected logical ``position`` of sequence ``row`` (-1: none)."""
    base = row * side_width(sink, recent)
    if position < sink:
        return base + position
    return base + sink + position % ring_size(recent) if recent else -1

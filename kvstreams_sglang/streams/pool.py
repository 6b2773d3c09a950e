"""Per-layer KV storage indexed by token slot: full precision or KV4-RL.

SGLang's split: ``StreamTable`` maps streams to slots, ``SlotAllocator`` hands slots
out, and a pool here only stores bytes per layer. Two storages:

- ``FullPrecisionPool``: ``k, v [num_slots, Hkv, D]`` per layer in the model's dtype
  (``kv_dtype="bf16"``: bf16 on GPU; fp32 tests keep fp32).
- ``KV4Pool``: one ``KV4LayerCache`` per layer (INT4 slots + INT8 side cache with
  ``side_width(sink, recent)`` side slots per stream row).

INT8 side cache rule under eviction (see ``kv4.regions``): a kept position ``p`` of a
stream whose computed end is ``end`` is attended through INT8 iff ``p < sink`` or
``p >= end - recent``, otherwise through INT4. A token writes its INT8 copy when it is
computed (sinks to their fixed side slot, others to ring slot ``p % (recent + 1)``); eviction
only removes positions from the index lists, so every kept position is in exactly one
region and nothing is ever rewritten.

A step writes only into its new tokens' slots, which were free, with one exception: a new
recent token's ring slot still holds the INT8 copy of the position ``recent + 1`` before it
(``kv4.cache``: the ring's spare slot). After the step that position is in the INT4 region; before
it, for a step of several tokens, it may still be in the window. The side caches of all layers live
in one tensor per field, so that a step saves what it will overwrite with one gather each
(``KV4Pool.save_side``) and a failed step puts it back (``restore_side``).
"""

from __future__ import annotations

import dataclasses

import torch

from ..kv4.cache import KV4LayerCache, int4_bytes_per_vector, int8_bytes_per_vector, side_slot, side_width


class FullPrecisionPool:
    kind = "bf16"

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, *,
                 dtype: torch.dtype, device):
        self.k = [torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
                  for _ in range(num_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


@dataclasses.dataclass
class SideCopy:
    """INT8 side entries saved by ``KV4Pool.save_side``: ``values[field]`` is ``[L, N, ...]``."""

    side_slots: torch.Tensor  # [N], -1 = nothing saved
    values: dict[str, torch.Tensor]


def kv4_layers(num_layers: int, num_slots: int, side_slots: int, num_kv_heads: int, head_dim: int,
               device=None) -> tuple[list[KV4LayerCache], dict[str, torch.Tensor]]:
    """Per-layer KV4 caches whose INT8 side caches are views of one tensor per field across layers
    (``[L, S8, Hkv, D]`` codes, ``[L, S8, Hkv]`` scales): a step's side entries, or a whole side row,
    are saved and restored with one copy per field instead of one per layer. Each layer's slots are padded to a
    multiple of 8, so every layer's views start 16-byte aligned whatever ``S8`` and ``Hkv`` (the CUDA decode takes
    only aligned caches: with 4 KV heads and an odd ``S8``, every odd layer's scales were 8 bytes off and that
    layer fell back to the Triton kernel)."""
    h, d = num_kv_heads, head_dim
    padded = -(-side_slots // 8) * 8
    i8, f16 = dict(dtype=torch.int8, device=device), dict(dtype=torch.float16, device=device)
    side = {"k_side": torch.zeros(num_layers, padded, h, d, **i8),
            "k_side_scale": torch.zeros(num_layers, padded, h, **f16),
            "v_side": torch.zeros(num_layers, padded, h, d, **i8),
            "v_side_scale": torch.zeros(num_layers, padded, h, **f16)}
    layers = [dataclasses.replace(KV4LayerCache.empty(num_slots, 0, h, d, device=device),
                                  **{name: t[layer, :side_slots] for name, t in side.items()})
              for layer in range(num_layers)]
    return layers, side


class KV4Pool:
    kind = "kv4rl"

    def __init__(self, num_layers: int, num_slots: int, max_streams: int, num_kv_heads: int, head_dim: int, *,
                 sink: int = 16, recent: int = 128, device=None):
        if sink < 0 or recent < 0:
            raise ValueError(f"sink and recent must be >= 0, got {sink}, {recent}")
        self.sink, self.recent = sink, recent
        self.layers, self.side = kv4_layers(num_layers, num_slots, max(1, max_streams * side_width(sink, recent)),
                                            num_kv_heads, head_dim, device)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)

    def save_side(self, side_slots: torch.Tensor) -> SideCopy:
        """Every layer's INT8 side entries at ``side_slots`` (``[N]``, -1 = none), before a step
        overwrites them. No host sync: a -1 reads slot 0, and ``restore_side`` skips it."""
        at = side_slots.clamp(min=0).long()
        return SideCopy(side_slots, {name: t[:, at] for name, t in self.side.items()})

    def restore_side(self, saved: SideCopy) -> None:
        keep = saved.side_slots >= 0
        at = saved.side_slots[keep].long()  # distinct: a step writes each side slot at most once
        for name, t in self.side.items():
            t[:, at] = saved.values[name][:, keep]

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """INT4 region: codes (4 bits/element) + fp16 scale and offset per token-head, K and V."""
        return 2 * num_layers * num_kv_heads * int4_bytes_per_vector(head_dim)

    @staticmethod
    def side_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """INT8 side cache, per protected (sink or recent) position: codes + fp16 scale, K and V."""
        return 2 * num_layers * num_kv_heads * int8_bytes_per_vector(head_dim)

    def side_slot(self, row: int, position: int) -> int:
        """Side slot a newly computed token at ``position`` writes its INT8 copy to."""
        return side_slot(row, position, sink=self.sink, recent=self.recent)

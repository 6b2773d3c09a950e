"""Per-layer KV storage indexed by token slot: full precision or KV4-RL.

SGLang's split: ``StreamTable`` maps streams to slots, ``SlotAllocator`` hands slots
out, and a pool here only stores bytes per layer. Two storages:

- ``FullPrecisionPool``: ``k, v [num_slots, Hkv, D]`` per layer in the model's dtype
  (``kv_dtype="bf16"``: bf16 on GPU; fp32 tests keep fp32).
- ``KV4Pool``: one ``KV4LayerCache`` per layer (INT4 slots + INT8 side cache with
  ``sink + recent`` side slots per stream row).

INT8 side cache rule under eviction (see ``kv4.regions``): a kept position ``p`` of a
stream whose computed end is ``end`` is attended through INT8 iff ``p < sink`` or
``p >= end - recent``, otherwise through INT4. A token writes its INT8 copy when it is
computed (sinks to their fixed side slot, others to ring slot ``p % recent``); eviction
only removes positions from the index lists, so every kept position is in exactly one
region and nothing is ever rewritten.
"""

from __future__ import annotations

import torch

from ..kv4.cache import KV4LayerCache, int4_bytes_per_vector, int8_bytes_per_vector, side_slot


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


class KV4Pool:
    kind = "kv4rl"

    def __init__(self, num_layers: int, num_slots: int, max_streams: int, num_kv_heads: int, head_dim: int, *,
                 sink: int = 16, recent: int = 128, device=None):
        if sink < 0 or recent < 0:
            raise ValueError(f"sink and recent must be >= 0, got {sink}, {recent}")
        self.sink, self.recent = sink, recent
        side = max(1, max_streams * (sink + recent))
        self.layers = [KV4LayerCache.empty(num_slots, side, num_kv_heads, head_dim, device=device)
                       for _ in range(num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers)

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

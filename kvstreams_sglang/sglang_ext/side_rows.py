"""The INT8 side rows of idle kv4rl streams.

The kv4rl pool (``pool.KV4TokenToKVPool``, layout in ``kv4.cache``) keeps the INT8 copies of a
sequence's protected positions (the first ``sink`` and the most recent ``recent``) in the side row
of the ``req_to_token`` row the sequence runs in. A KV stream holds no row between turns (its KV is
tree KV, ``stream_cache``), so its side row is copied out when a turn ends and back under the next
turn's row before that turn's first forward. The copies are what a row kept across turns would have
held: the same entries, so the attention is unchanged.
"""

from __future__ import annotations

import torch


class SideRows:
    def __init__(self, pool):
        self.pool = pool
        self.width = pool.sink + pool.recent  # side slots per row

    def _tensors(self, layer) -> tuple[torch.Tensor, ...]:
        return layer.k_side, layer.k_side_scale, layer.v_side, layer.v_side_scale

    def empty(self) -> list[tuple[torch.Tensor, ...]]:
        """A side row, per layer (zeros: nothing protected is computed yet)."""
        return [tuple(torch.zeros_like(t[: self.width]) for t in self._tensors(layer)) for layer in self.pool.layers]

    def load(self, saved: list, row: int) -> None:
        """``saved`` under request row ``row``."""
        rows = slice(row * self.width, (row + 1) * self.width)
        for layer, parts in zip(self.pool.layers, saved, strict=True):
            for t, part in zip(self._tensors(layer), parts, strict=True):
                t[rows].copy_(part)

    def save(self, saved: list, row: int) -> None:
        """Request row ``row``'s side row into ``saved``."""
        rows = slice(row * self.width, (row + 1) * self.width)
        for layer, parts in zip(self.pool.layers, saved, strict=True):
            for t, part in zip(self._tensors(layer), parts, strict=True):
                part.copy_(t[rows])

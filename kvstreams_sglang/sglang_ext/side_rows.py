"""The INT8 side rows of idle kv4rl streams.

The kv4rl pool (``pool.KV4TokenToKVPool``, layout in ``kv4.cache``) keeps the INT8 copies of a
sequence's protected positions (the first ``sink`` and the most recent ``recent``) in the side row
of the ``req_to_token`` row the sequence runs in. A KV stream holds no row between turns (its KV is
tree KV, ``stream_cache``), so its side row is copied out when a turn ends and back under the next
turn's row before that turn's first forward. The copies are what a row kept across turns would have
held: the same entries, so the attention is unchanged.

Every copy runs on the model runner's forward stream (``pool.forward_stream``), in order with the
forwards: under overlap scheduling a turn's end is processed while the next batch (which may still decode
the finished request once) runs, and a row's next request loads its side row in its own forward.
"""

from __future__ import annotations

import contextlib

import torch

from ..kv4.cache import side_width


class SideRows:
    """Side rows are saved as one tensor per field across layers (``streams.pool.kv4_layers``): a load or
    a save is four copies, whatever the depth of the model."""

    def __init__(self, pool):
        self.pool = pool
        self.width = side_width(pool.sink, pool.recent)  # side slots per row
        stream = getattr(pool, "forward_stream", None)
        on_cuda = isinstance(stream, torch.cuda.Stream)  # (off CUDA every copy is in order already)
        self._on_forward_stream = (lambda: torch.cuda.stream(stream)) if on_cuda else contextlib.nullcontext

    def _rows(self, row: int) -> slice:
        return slice(row * self.width, (row + 1) * self.width)

    def empty(self) -> dict[str, torch.Tensor]:
        """A side row, every layer (zeros: nothing protected is computed yet)."""
        with self._on_forward_stream():
            return {name: torch.zeros_like(t[:, : self.width]) for name, t in self.pool.side.items()}

    def load(self, saved: dict[str, torch.Tensor], row: int) -> None:
        """``saved`` under request row ``row``."""
        with self._on_forward_stream():
            for name, t in self.pool.side.items():
                t[:, self._rows(row)].copy_(saved[name])

    def save(self, saved: dict[str, torch.Tensor], row: int) -> None:
        """Request row ``row``'s side row into ``saved``."""
        with self._on_forward_stream():
            for name, t in self.pool.side.items():
                saved[name].copy_(t[:, self._rows(row)])

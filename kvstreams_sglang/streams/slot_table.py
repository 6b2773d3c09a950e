"""Device mirror of every stream's kept slots and positions (SGLang's ``ReqToTokenPool``).

``KVStream`` keeps the truth in Python lists; attention needs it on the device every
step. Row ``r`` of ``slots [max_streams, max_context]`` holds the kept slots of the
stream in row ``r`` in position order, ``positions`` their logical positions, and
``lengths[r]`` how many are valid. Appending writes only the new entries; an eviction
rewrites the row once. Batch metadata is then a gather over rows, with no per-token
Python work per step.
"""

from __future__ import annotations

import torch


class ContextLengthError(RuntimeError):
    """A stream would keep more live tokens than a row of the table holds (``max_context``)."""


class SlotTable:
    def __init__(self, max_streams: int, max_context: int, device):
        self.max_context = max_context
        self.slots = torch.zeros(max_streams, max_context, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_streams, max_context, dtype=torch.int32, device=device)
        self.lengths = [0] * max_streams

    def _check(self, row: int, n: int) -> None:
        if n > self.max_context:
            raise ContextLengthError(f"stream row {row} would hold {n} live tokens, more than max_context="
                                     f"{self.max_context}: evict (compact) or raise max_context")

    def append(self, row: int, slots: torch.Tensor, positions: torch.Tensor) -> None:
        start, n = self.lengths[row], slots.numel()
        self._check(row, start + n)
        self.slots[row, start:start + n] = slots
        self.positions[row, start:start + n] = positions
        self.lengths[row] = start + n

    def append_batch(self, rows: list[int], counts: list[int], slots: list[int], first_positions: list[int]) -> None:
        """``append`` for many rows with one indexed write (the per-step path). Every row is
        checked before any changes."""
        for row, n in zip(rows, counts, strict=True):
            self._check(row, self.lengths[row] + n)
        row_idx, col_idx, pos = [], [], []
        for row, n, p0 in zip(rows, counts, first_positions, strict=True):
            start = self.lengths[row]
            row_idx.extend([row] * n)
            col_idx.extend(range(start, start + n))
            pos.extend(range(p0, p0 + n))
            self.lengths[row] = start + n
        dev = self.slots.device
        r = torch.tensor(row_idx, dtype=torch.long, device=dev)
        c = torch.tensor(col_idx, dtype=torch.long, device=dev)
        self.slots[r, c] = torch.tensor(slots, dtype=torch.int32, device=dev)
        self.positions[r, c] = torch.tensor(pos, dtype=torch.int32, device=dev)

    def rewrite(self, row: int, slots: list[int], positions: list[int]) -> None:
        self._check(row, len(slots))
        dev = self.slots.device
        self.slots[row, :len(slots)] = torch.tensor(slots, dtype=torch.int32, device=dev)
        self.positions[row, :len(positions)] = torch.tensor(positions, dtype=torch.int32, device=dev)
        self.lengths[row] = len(slots)

    def truncate(self, row: int, length: int) -> None:
        """Forget the row's entries past ``length`` (undoes an append: the entries before it were
        never written)."""
        if not 0 <= length <= self.lengths[row]:
            raise ValueError(f"stream row {row} holds {self.lengths[row]} entries, cannot truncate to {length}")
        self.lengths[row] = length

    def clear(self, row: int) -> None:
        self.lengths[row] = 0

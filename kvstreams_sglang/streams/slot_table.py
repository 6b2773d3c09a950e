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


class SlotTable:
    def __init__(self, max_streams: int, max_context: int, device):
        self.max_context = max_context
        self.slots = torch.zeros(max_streams, max_context, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_streams, max_context, dtype=torch.int32, device=device)
        self.lengths = [0] * max_streams

    def _check(self, row: int, n: int) -> None:
        if n > self.max_context:
            raise RuntimeError(f"stream row {row} would hold {n} live tokens, more than max_context="
                               f"{self.max_context}: evict (compact) or raise max_context")

    def append(self, row: int, slots: torch.Tensor, positions: torch.Tensor) -> None:
        start, n = self.lengths[row], slots.numel()
        self._check(row, start + n)
        self.slots[row, start:start + n] = slots
        self.positions[row, start:start + n] = positions
        self.lengths[row] = start + n

    def append_batch(self, rows: list[int], counts: list[int], slots: list[int], first_positions: list[int]) -> None:
        """``append`` for many rows with one indexed write (the per-step path)."""
        row_idx, col_idx, pos = [], [], []
        for row, n, p0 in zip(rows, counts, first_positions, strict=True):
            start = self.lengths[row]
            self._check(row, start + n)
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

    def clear(self, row: int) -> None:
        self.lengths[row] = 0

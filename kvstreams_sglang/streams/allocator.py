"""Token-slot allocator (page size 1): the map from "a token needs KV" to a row of the pool.

Page size 1 is what makes in-place eviction exact: evicting any token frees exactly its
slot, with no half-used pages. Like SGLang's ``TokenToKVPoolAllocator``, it only hands
out and takes back integers; the streams own which slot holds which token.
"""

from __future__ import annotations

from collections.abc import Iterable


class OutOfSlotsError(RuntimeError):
    """The pool cannot hold the requested tokens: evict, close streams or size it larger."""


class SlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        # LIFO free list: recently freed slots are reused first (warm in cache).
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._used = bytearray(num_slots)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfSlotsError(f"need {n} KV slots, {len(self._free)} of {self.num_slots} free")
        out = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        for s in out:
            self._used[s] = 1
        return out

    def free(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        bad = [s for s in slots if not (0 <= s < self.num_slots) or not self._used[s]]
        if bad or len(set(slots)) != len(slots):
            raise ValueError(f"freeing slots that are not allocated (or twice): {sorted(bad or slots)[:8]}")
        for s in slots:
            self._used[s] = 0
        self._free.extend(reversed(slots))

    def is_used(self, slot: int) -> bool:
        return bool(self._used[slot])

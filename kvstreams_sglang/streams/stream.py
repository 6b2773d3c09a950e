"""A KV stream in the built-in engine: a ``StreamLedger`` plus where its KV lives.

The ledger (``trainer_masks.StreamLedger``) owns the stream's truth: tokens, sources, sampler
logprobs and versions, the computed count, the kept positions and the evictions (validated
there, once). The engine adds a row (per-stream tables such as the INT8 side cache, like
SGLang's ``req_pool_idx``) and the slots of the kept computed tokens, aligned with
``ledger.live``. Stream index = logical (RoPE) position: eviction removes tokens without
renumbering the rest, and new tokens continue from the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer_masks import StreamLedger

from .allocator import SlotAllocator


@dataclass
class KVStream:
    sid: int
    row: int  # per-stream row in side tables (INT8 side cache), like SGLang's req_pool_idx
    ledger: StreamLedger
    slots: list[int] = field(default_factory=list)  # slots of the kept computed tokens, aligned with ledger.live

    @property
    def positions(self) -> list[int]:
        """Logical positions of the kept computed tokens (``slots[i]`` holds ``positions[i]``)."""
        return self.ledger.live

    def commit(self, slots: list[int]) -> None:
        """The next ``len(slots)`` pending tokens were computed into ``slots``."""
        self.ledger.commit(len(slots))
        self.slots.extend(slots)

    def evict(self, spans) -> list[int]:
        """Drop the KV of ``spans`` (validated by the ledger; nothing changes if invalid);
        returns the freed slots (the caller frees them)."""
        eviction = self.ledger.check_evict(spans)
        dropped = set(eviction.dropped)
        freed = [self.slots[i] for i in eviction.dropped]
        self.slots = [s for i, s in enumerate(self.slots) if i not in dropped]
        self.ledger.apply(eviction)
        return freed

    def position_runs(self) -> list[tuple[int, int, int]]:
        """The position map as runs ``(slot_start, logical_start, length)`` where both the
        slots and the positions are consecutive."""
        runs: list[tuple[int, int, int]] = []
        for s, p in zip(self.slots, self.positions, strict=True):
            if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == p:
                runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
            else:
                runs.append((s, p, 1))
        return runs


class StreamTable:
    """Open streams plus the slot allocator and the row allocator they draw from."""

    def __init__(self, num_slots: int, max_streams: int):
        self.allocator = SlotAllocator(num_slots)
        self.max_streams = max_streams
        self._free_rows = list(range(max_streams - 1, -1, -1))
        self.streams: dict[int, KVStream] = {}
        self._next_sid = 0

    def open(self, stream: list[int] | StreamLedger) -> KVStream:
        """A new stream on ``stream``'s tokens; a ``StreamLedger`` (nothing computed yet) is adopted."""
        ledger = stream if isinstance(stream, StreamLedger) else StreamLedger(stream)
        if ledger.num_computed:
            raise ValueError("a stream opens with nothing computed; its tokens are prefilled by the engine")
        if not self._free_rows:
            raise RuntimeError(f"too many open streams (max_streams={self.max_streams}); close some first")
        ledger.name = f"stream {self._next_sid}"
        stream = KVStream(sid=self._next_sid, row=self._free_rows.pop(), ledger=ledger)
        self.streams[stream.sid] = stream
        self._next_sid += 1
        return stream

    def get(self, sid: int) -> KVStream:
        try:
            return self.streams[sid]
        except KeyError:
            raise KeyError(f"no open stream {sid}") from None

    def evict(self, sid: int, spans) -> int:
        freed = self.get(sid).evict(spans)
        self.allocator.free(freed)
        return len(freed)

    def close(self, sid: int) -> KVStream:
        stream = self.streams.pop(sid)
        self.allocator.free(stream.slots)
        stream.slots = []
        self._free_rows.append(stream.row)
        return stream

    def check(self) -> None:
        """Invariant: every used slot belongs to exactly one live token of one stream."""
        owned = [s for st in self.streams.values() for s in st.slots]
        if len(owned) != len(set(owned)):
            raise AssertionError("a slot is owned twice")
        if len(owned) != self.allocator.num_used:
            raise AssertionError(f"{self.allocator.num_used} slots in use but streams own {len(owned)}")
        if any(not self.allocator.is_used(s) for s in owned):
            raise AssertionError("a stream owns a free slot")

"""A KV stream: one sequence whose KV is appended, generated into and evicted in place.

Stream index = logical (RoPE) position: token ``i`` of the stream is computed at
position ``i`` and keeps it for life; eviction removes tokens without renumbering the
rest, and new tokens continue from the end. The stream owns the slots of its kept,
computed tokens; tokens appended or sampled but not yet run through the model are
*pending* and own no slot yet (a sampled token's KV is computed on the next step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .allocator import SlotAllocator


class EvictionError(ValueError):
    """An ``evict`` call that would be invalid; nothing was changed."""


def validate_spans(spans, *, live_positions, num_computed: int, end: int, name: str) -> list[tuple[int, int]]:
    """Eviction spans (``[start, end)`` logical positions) of a stream, sorted, or an
    ``EvictionError`` saying what is wrong: every position must be computed
    (``< num_computed``) and still live (in ``live_positions``), spans must not overlap.
    Shared by the built-in engine and the SGLang session eviction."""
    try:
        spans = sorted((int(a), int(b)) for a, b in spans)
    except (TypeError, ValueError) as e:
        raise EvictionError(f"{name}: spans must be (start, end) pairs, got {spans!r}") from e
    prev_end = -1
    for start, stop in spans:
        if start >= stop:
            raise EvictionError(f"{name}: empty or reversed span [{start}, {stop})")
        if start < 0 or stop > end:
            raise EvictionError(f"{name}: span [{start}, {stop}) is outside the stream [0, {end})")
        if stop > num_computed:
            raise EvictionError(
                f"{name}: span [{start}, {stop}) reaches token {num_computed}, which is pending "
                f"(being generated or not yet prefilled); only computed tokens [0, {num_computed}) can "
                f"be evicted")
        if start < prev_end:
            raise EvictionError(f"{name}: spans overlap at [{start}, {prev_end})")
        prev_end = stop
    live = set(live_positions)
    for start, stop in spans:
        missing = [p for p in range(start, stop) if p not in live]
        if missing:
            raise EvictionError(f"{name}: positions {missing[:5]}{'...' if len(missing) > 5 else ''} "
                                f"in span [{start}, {stop}) were already evicted")
    return spans


@dataclass
class KVStream:
    sid: int
    row: int  # per-stream row in side tables (INT8 side cache), like SGLang's req_pool_idx
    token_ids: list[int] = field(default_factory=list)  # every token, stream order, evicted included
    num_computed: int = 0  # tokens [0, num_computed) have had their KV computed
    slots: list[int] = field(default_factory=list)  # slots of kept computed tokens, in position order
    positions: list[int] = field(default_factory=list)  # logical position of each kept computed token
    evictions: list[tuple[int, tuple[tuple[int, int], ...]]] = field(default_factory=list)
    # What the trainer needs per token (see trainer_masks.StreamRecord).
    sources: list[str] = field(default_factory=list)  # prompt | model | env
    logprobs: list[float | None] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)

    def add(self, token_ids: list[int], source: str) -> None:
        """Append non-sampled tokens (prompt or environment): they become pending."""
        self.token_ids.extend(token_ids)
        self.sources.extend([source] * len(token_ids))
        self.logprobs.extend([None] * len(token_ids))
        self.versions.extend([None] * len(token_ids))

    def add_sampled(self, token_id: int, logprob: float, version: int) -> None:
        self.token_ids.append(token_id)
        self.sources.append("model")
        self.logprobs.append(logprob)
        self.versions.append(version)

    @property
    def end(self) -> int:
        """Next logical position (= number of tokens ever in the stream)."""
        return len(self.token_ids)

    @property
    def pending(self) -> list[int]:
        return self.token_ids[self.num_computed:]

    @property
    def num_live(self) -> int:
        """Tokens whose KV is resident."""
        return len(self.slots)

    def commit(self, slots: list[int]) -> None:
        """Record that the next ``len(slots)`` pending tokens were computed into ``slots``."""
        n = len(slots)
        if n > len(self.token_ids) - self.num_computed:
            raise ValueError(f"stream {self.sid}: committing {n} tokens but only "
                             f"{len(self.token_ids) - self.num_computed} are pending")
        self.positions.extend(range(self.num_computed, self.num_computed + n))
        self.slots.extend(slots)
        self.num_computed += n

    def to_record(self, **meta):
        """The stream as the trainer replays it (``trainer_masks.StreamRecord``)."""
        from trainer_masks import StreamRecord

        return StreamRecord(
            token_ids=list(self.token_ids), positions=list(range(len(self.token_ids))), sources=list(self.sources),
            loss_mask=[s == "model" for s in self.sources], logprobs=list(self.logprobs),
            policy_versions=list(self.versions),
            evictions=[dict(at_index=at, spans=spans) for at, spans in self.evictions], meta=meta)

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

    def validate_evict(self, spans) -> list[tuple[int, int]]:
        """Check ``spans`` (``[start, end)`` logical positions) without changing anything."""
        return validate_spans(spans, live_positions=self.positions, num_computed=self.num_computed, end=self.end,
                              name=f"stream {self.sid}")

    def evict(self, spans) -> list[int]:
        """Drop the KV of ``spans``; returns the freed slots (the caller frees them)."""
        spans = self.validate_evict(spans)
        dead = set()
        for start, end in spans:
            dead.update(range(start, end))
        freed = [s for s, p in zip(self.slots, self.positions, strict=True) if p in dead]
        keep = [(s, p) for s, p in zip(self.slots, self.positions, strict=True) if p not in dead]
        self.slots = [s for s, _ in keep]
        self.positions = [p for _, p in keep]
        self.evictions.append((self.num_computed, tuple(spans)))
        return freed


class StreamTable:
    """Open streams plus the slot allocator and the row allocator they draw from."""

    def __init__(self, num_slots: int, max_streams: int):
        self.allocator = SlotAllocator(num_slots)
        self.max_streams = max_streams
        self._free_rows = list(range(max_streams - 1, -1, -1))
        self.streams: dict[int, KVStream] = {}
        self._next_sid = 0

    def open(self, token_ids: list[int]) -> KVStream:
        if not self._free_rows:
            raise RuntimeError(f"too many open streams (max_streams={self.max_streams}); close some first")
        stream = KVStream(sid=self._next_sid, row=self._free_rows.pop())
        stream.add(list(token_ids), "prompt")
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
        stream.slots, stream.positions = [], []
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

"""`StreamLedger`: the one owner of a KV stream's truth.

A stream is a token sequence in stream order; token ``i`` is computed at RoPE position ``i``
and keeps it for life. The ledger records, per token, its id, its source (prompt / model /
env), the sampler's logprob and policy version; how many tokens have had their KV computed
(``num_computed``: tokens ``[0, num_computed)``; the rest are *pending*); which computed tokens
are still live (kept in the KV cache), in position order; and the eviction events. That is
everything the trainer replays (``to_record``) and everything an engine needs to know about a
stream apart from where its KV lives.

Everything else is a view of a ledger: the built-in engine's ``KVStream`` adds a row and the
kept tokens' slots, the SGLang client's session adds a session id and how many tokens the
server holds, the SFT expert client uses a bare ledger, and the agent loop's conversation
keeps only its turn structure over it. Evictions are validated here, once.
"""

from __future__ import annotations

import operator
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .record import EvictionEvent, Source, StreamRecord

Span = tuple[int, int]


class EvictionError(ValueError):
    """An eviction that would be invalid; nothing was changed."""


@dataclass(frozen=True)
class Eviction:
    """A validated eviction of one ledger: its sorted spans, and the indices into the ledger's
    live list of the tokens it drops (a view with per-token state, such as slots aligned with
    ``live``, drops the same indices)."""

    spans: tuple[Span, ...]
    dropped: tuple[int, ...]


def _as_span(span) -> Span:
    try:
        start, end = span
        if isinstance(start, bool) or isinstance(end, bool):
            raise TypeError
        return operator.index(start), operator.index(end)  # ints only: 1.7 is refused, not truncated
    except (TypeError, ValueError):
        raise EvictionError(f"spans must be [start, end) pairs of integers, got {span!r}") from None


def check_spans(spans: Iterable, *, live: Sequence[int], num_computed: int, end: int, name: str) -> Eviction:
    """The eviction rule, for a ledger or any holder of the same state (the SGLang server's view of
    a session): ``spans`` are ``[start, end)`` positions of integers; every position must be
    computed (pending tokens have no KV to drop, ``< num_computed``) and still in ``live`` (the
    kept computed positions, ascending), and spans must not overlap. Returns the sorted spans and
    the indices into ``live`` they drop, or raises ``EvictionError`` saying what is wrong."""
    spans = sorted(_as_span(s) for s in spans)
    prev_end = -1
    for start, stop in spans:
        if start >= stop:
            raise EvictionError(f"{name}: empty or reversed span [{start}, {stop})")
        if start < 0 or stop > end:
            raise EvictionError(f"{name}: span [{start}, {stop}) is outside the stream [0, {end})")
        if stop > num_computed:
            raise EvictionError(
                f"{name}: span [{start}, {stop}) reaches token {num_computed}, which is pending (being generated "
                f"or not yet prefilled); only computed tokens [0, {num_computed}) can be evicted")
        if start < prev_end:
            raise EvictionError(f"{name}: spans overlap at [{start}, {prev_end})")
        prev_end = stop
    dropped: list[int] = []
    for start, stop in spans:
        lo, hi = bisect_left(live, start), bisect_left(live, stop)
        if hi - lo != stop - start:
            have = set(live[lo:hi])
            missing = [p for p in range(start, stop) if p not in have]
            raise EvictionError(f"{name}: positions {missing[:5]}{'...' if len(missing) > 5 else ''} in span "
                                f"[{start}, {stop}) were already evicted")
        dropped.extend(range(lo, hi))
    return Eviction(tuple(spans), tuple(dropped))


class StreamLedger:
    def __init__(self, token_ids: Iterable[int] = (), source: Source = "prompt", *, name: str = "stream"):
        self.name = name  # how errors refer to the stream ("stream 3", "session 'ab12'")
        self.token_ids: list[int] = []
        self.sources: list[Source] = []
        self.logprobs: list[float | None] = []
        self.versions: list[int | None] = []
        self.num_computed = 0
        self.live: list[int] = []  # positions of the kept computed tokens, ascending
        self.evictions: list[EvictionEvent] = []
        self.append(token_ids, source)

    # ---- reading ----
    @property
    def end(self) -> int:
        """The next position (= number of tokens ever in the stream)."""
        return len(self.token_ids)

    @property
    def num_pending(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def pending(self) -> list[int]:
        """Tokens appended or sampled whose KV is not computed yet."""
        return self.token_ids[self.num_computed:]

    @property
    def num_live(self) -> int:
        """Tokens whose KV is kept."""
        return len(self.live)

    def is_live(self, position: int) -> bool:
        i = bisect_left(self.live, position)
        return i < len(self.live) and self.live[i] == position

    def live_ranges(self, start: int, end: int) -> list[Span]:
        """Maximal runs of positions in ``[start, end)`` that are not evicted (pending ones count
        as live: nothing has evicted them)."""
        runs: list[Span] = []
        for p in range(start, end):
            if p < self.num_computed and not self.is_live(p):
                continue
            if runs and runs[-1][1] == p:
                runs[-1] = (runs[-1][0], p + 1)
            else:
                runs.append((p, p + 1))
        return runs

    # ---- writing ----
    def append(self, token_ids: Iterable[int], source: Source = "env") -> None:
        """Tokens that were not sampled (prompt, environment, summary instruction): pending."""
        ids = list(token_ids)
        self.token_ids.extend(ids)
        self.sources.extend([source] * len(ids))
        self.logprobs.extend([None] * len(ids))
        self.versions.extend([None] * len(ids))

    def add_sampled(self, token_id: int, logprob: float, version: int) -> None:
        """A sampled token: pending until the next forward computes its KV."""
        self.token_ids.append(token_id)
        self.sources.append("model")
        self.logprobs.append(logprob)
        self.versions.append(version)

    def commit(self, n: int) -> range:
        """The next ``n`` pending tokens were computed (in order); returns their positions."""
        if not 0 <= n <= self.num_pending:
            raise ValueError(f"{self.name}: committing {n} tokens but {self.num_pending} are pending")
        computed = range(self.num_computed, self.num_computed + n)
        self.live.extend(computed)
        self.num_computed += n
        return computed

    def check_evict(self, spans: Iterable) -> Eviction:
        """Validate ``spans`` without changing anything (``check_spans``)."""
        return check_spans(spans, live=self.live, num_computed=self.num_computed, end=self.end, name=self.name)

    def apply(self, eviction: Eviction) -> None:
        """Apply an eviction ``check_evict`` returned (nothing may have changed in between)."""
        if not eviction.spans:
            return
        drop = set(eviction.dropped)
        self.live = [p for i, p in enumerate(self.live) if i not in drop]
        self.evictions.append(EvictionEvent(at_index=self.num_computed, spans=eviction.spans))

    def evict(self, spans: Iterable) -> Eviction:
        """Drop ``spans`` from the live tokens; records the event at the computed boundary (every
        token computed from now on no longer sees them)."""
        eviction = self.check_evict(spans)
        self.apply(eviction)
        return eviction

    def reopen(self, kept: Sequence[int]) -> StreamLedger:
        """The re-prefill baseline's next context window: a fresh stream holding the tokens at
        positions ``kept`` (all pending, renumbered from 0, as a conventional engine prefills a
        new request). Sampled tokens among them are context now, not the window's output."""
        ascending = all(a < b for a, b in zip(kept, kept[1:], strict=False))
        if not ascending or (kept and not 0 <= kept[0] <= kept[-1] < self.end):
            raise ValueError(f"{self.name}: reopen needs ascending positions inside [0, {self.end})")
        return StreamLedger([self.token_ids[p] for p in kept], "prompt", name=self.name)

    def to_record(self, **meta) -> StreamRecord:
        """The stream as the trainer replays it."""
        return StreamRecord(
            token_ids=list(self.token_ids), positions=list(range(self.end)), sources=list(self.sources),
            loss_mask=[s == "model" for s in self.sources], logprobs=list(self.logprobs),
            policy_versions=list(self.versions), evictions=list(self.evictions), meta=meta)

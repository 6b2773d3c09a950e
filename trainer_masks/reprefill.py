"""The re-prefill baseline: the same episode as a conventional engine would have run it.

Without in-place eviction, compacting the context means starting a new request: the kept tokens
are prefilled again from position 0, then generation continues. Each such request is a context
window; the trainer of that baseline sees one ``StreamRecord`` per window. The kept tokens of a
window are exactly the keys visible to its first new query (``k <= at_index < death[k]``), so every
new token sees the same token ids as in the KV stream, only at shifted positions, and with its
context's KV recomputed. ``reprefilled_tokens`` counts that recomputation: the work KV-streams
avoids.
"""

from __future__ import annotations

from dataclasses import dataclass

from .record import StreamRecord


@dataclass(frozen=True)
class ContextWindow:
    """One re-prefill request: ``kept`` stream indices prefilled again, then new tokens
    ``[start, end)`` of the stream."""

    kept: tuple[int, ...]
    start: int
    end: int


def context_windows(record: StreamRecord) -> list[ContextWindow]:
    """Split a stream at its evictions. Several events at one ``at_index`` are one compaction;
    a compaction before the first or after the last token starts no window (nothing new to
    compute)."""
    n = len(record)
    death = record.death()
    cuts = sorted({ev.at_index for ev in record.evictions if 0 < ev.at_index < n})
    bounds = [0, *cuts, n]
    windows = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        kept = tuple(k for k in range(start) if k <= start < death[k])
        windows.append(ContextWindow(kept, start, end))
    return windows


def reprefill_segments(record: StreamRecord) -> list[StreamRecord]:
    """One eviction-free record per context window, positions restarting at 0.

    Re-prefilled tokens keep their source but carry no loss and no sampler logprob: they were
    trained in the window that generated them. ``policy_versions`` are kept (who sampled a token
    does not change). ``meta["stream_indices"]`` maps each segment token back to the stream.
    """
    segments = []
    for i, w in enumerate(context_windows(record)):
        new = list(range(w.start, w.end))
        idx = [*w.kept, *new]
        fresh = [False] * len(w.kept) + [True] * len(new)
        segments.append(
            StreamRecord(
                token_ids=[record.token_ids[k] for k in idx],
                positions=list(range(len(idx))),
                sources=[record.sources[k] for k in idx],
                loss_mask=[f and record.loss_mask[k] for k, f in zip(idx, fresh, strict=True)],
                logprobs=[record.logprobs[k] if f else None for k, f in zip(idx, fresh, strict=True)],
                policy_versions=[record.policy_versions[k] for k in idx],
                meta={**record.meta, "segment": i, "stream_indices": idx},
            )
        )
    return segments


def reprefilled_tokens(record: StreamRecord) -> int:
    """Tokens whose KV the re-prefill baseline computes a second (or further) time."""
    return sum(len(w.kept) for w in context_windows(record))

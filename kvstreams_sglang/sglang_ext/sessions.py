"""In-place eviction for SGLang streaming sessions, and the position offset it leaves.

A streaming session (``open_session(streaming=True)``) keeps one request row of
``req_to_token`` across turns (``StreamingSession.slots[sid]``, SGLang 0.5.17) and the
finished request whose ``origin_input_ids + output_ids`` is the session's token list; the
next turn is prefilled from ``kv_committed_len`` on. Evicting spans therefore means: free the
spans' KV slots, compact the row (kept slots keep their order), shorten the committed/allocated
lengths and the token list by the same count (and the token arrays' lengths the session rolls
back to, ``Session.committed_*_len``), and remember how many positions the row is now behind
the stream. That count is the session's position offset: the next token's RoPE
position is ``row index + offset``, so new tokens keep counting from the stream's position
and kept KV keeps the position it was computed at (``patches`` adds the offset to
``ForwardBatch.positions``).

Spans are stream (logical) positions, validated exactly as the built-in engine's
(``trainer_masks.check_spans``); an invalid call raises ``EvictionError`` and changes nothing.
"""

from __future__ import annotations

from array import array

import torch

from trainer_masks import EvictionError, check_spans

OFFSET_ATTR = "kvstreams_offset"  # on sglang's Session: positions evicted so far
POSITIONS_ATTR = "kvstreams_positions"  # on sglang's Session: logical positions of the row, as of the last eviction


def position_offset(req) -> int:
    """Position offset of a request: its streaming session's evicted count, else 0."""
    session = getattr(req, "session", None)
    return getattr(session, OFFSET_ATTR, 0) if session is not None else 0


def session_tokens(req) -> list[int]:
    """The session's token list as its next turn will see it (``Session.create_req``): a
    prefill-only turn (``max_new_tokens=0``) samples one token that is not part of it."""
    return list(req.origin_input_ids) + list(req.output_ids[:req.sampling_params.max_new_tokens])


def _session_slots(tree_cache) -> dict:
    """The streaming-session slots: on the ``StreamingSession`` wrapper (``--disable-radix-cache``: it wraps a
    ``ChunkCache``), or on the one a ``UnifiedRadixCache`` embeds."""
    slots = getattr(tree_cache, "slots", None)
    if slots is None:
        slots = getattr(getattr(tree_cache, "session", None), "slots", None)
    return slots if slots is not None else {}


def _session_state(scheduler, session_id: str):
    session = scheduler.session_controller.get(session_id)
    if session is None:
        raise EvictionError(f"session {session_id!r} is not open")
    if not session.streaming:
        raise EvictionError(f"session {session_id!r} is not a streaming session (open it with streaming=True)")
    slot = _session_slots(scheduler.tree_cache).get(session_id)
    if slot is None or not slot.is_holding_kv:
        raise EvictionError(f"session {session_id!r} holds no KV yet: run a turn first")
    if len(session.req_nodes) != 1:
        raise EvictionError(f"session {session_id!r} has no finished turn to evict from")
    req = next(iter(session.req_nodes.values())).req
    # req_nodes keeps the last finished turn while the next one runs (Session._inflight), whose token arrays are
    # that turn's, extended in place
    if not req.finished() or getattr(session, "_inflight", False):
        raise EvictionError(f"session {session_id!r} is generating; evict between turns")
    if slot.cache_protected_len:
        raise EvictionError("kv-streams eviction needs --disable-radix-cache (the session's prefix is shared "
                            "with the radix tree)")
    return session, slot, req


def live_positions(session, num_rows: int) -> list[int]:
    """Logical positions of the session row's first ``num_rows`` entries."""
    known = list(getattr(session, POSITIONS_ATTR, []))
    offset = getattr(session, OFFSET_ATTR, 0)
    return known[:num_rows] + [i + offset for i in range(len(known), num_rows)]


def session_info(scheduler, session_id: str) -> dict:
    session, slot, req = _session_state(scheduler, session_id)
    offset = getattr(session, OFFSET_ATTR, 0)
    n = slot.kv_committed_len
    row = scheduler.tree_cache.req_to_token_pool.req_to_token[slot.req_pool_idx, :n]
    return dict(session_id=session_id, live_tokens=n, evicted_tokens=offset,
                stream_length=len(session_tokens(req)) + offset,
                req_pool_idx=slot.req_pool_idx, slots=row.tolist(), positions=live_positions(session, n))


def evict_session_spans(scheduler, session_id: str, spans) -> dict:
    """Evict ``spans`` from a streaming session's KV in place; returns ``session_info`` after."""
    session, slot, req = _session_state(scheduler, session_id)
    n = slot.kv_committed_len
    offset = getattr(session, OFFSET_ATTR, 0)
    positions = live_positions(session, n)
    tokens = session_tokens(req)
    spans = check_spans(spans, live=positions, num_computed=n + offset, end=len(tokens) + offset,
                        name=f"session {session_id!r}").spans
    dead = set()
    for start, stop in spans:
        dead.update(range(start, stop))
    drop = [i for i, p in enumerate(positions) if p in dead]
    keep = [i for i, p in enumerate(positions) if p not in dead]

    pool = scheduler.tree_cache.req_to_token_pool
    allocator = scheduler.tree_cache.token_to_kv_pool_allocator
    row = pool.req_to_token[slot.req_pool_idx]
    dev = row.device
    tail = list(range(n, slot.kv.kv_allocated_len))  # allocated past the committed tokens (none without overlap)
    order = torch.tensor(keep + tail, dtype=torch.long, device=dev)
    freed = row[torch.tensor(drop, dtype=torch.long, device=dev)].to(torch.int64)
    row[:order.numel()] = row[order].clone()
    allocator.free(freed)

    slot.kv_committed_len -= len(drop)
    slot.kv.kv_allocated_len -= len(drop)
    dropped = set(drop)
    kept_tokens = [t for i, t in enumerate(tokens) if i not in dropped]
    # the next turn extends these arrays in place (Session._share_token_arrays), after trimming them to the
    # session's committed lengths: fresh arrays, committed at their full length
    req.origin_input_ids = array("q", kept_tokens)
    req.origin_input_ids_unpadded = array("q", kept_tokens)
    req.full_untruncated_fill_ids = array("q", kept_tokens)
    req.output_ids = array("q")
    session.committed_origin_len = session.committed_unpadded_len = session.committed_fill_len = len(kept_tokens)
    setattr(session, POSITIONS_ATTR, [positions[i] for i in keep])
    setattr(session, OFFSET_ATTR, offset + len(drop))
    return session_info(scheduler, session_id) | dict(evicted=len(drop))

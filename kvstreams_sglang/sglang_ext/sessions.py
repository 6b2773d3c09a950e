"""A KV stream's SGLang session: its token arrays, and the checks a turn passes before SGLang sees it.

A streaming session (``open_session(streaming=True)``, SGLang 0.5.17) keeps the finished request of
its last turn; that request's ``origin_input_ids + output_ids[:max_new_tokens]``, cut back to the
lengths ``Session.finish_req`` confirmed (``committed_*_len``), is the stream's compacted token list,
and ``Session.create_req`` extends those arrays in place with the next turn's input. An in-place
eviction rewrites them (``replace_session_tokens``).

``refusal`` is the guard a turn passes in the scheduler (``patches``), answered as a 400 with the
reason and the session left as it was: token ids outside the vocabulary (they would crash the
scheduler), and a turn whose KV or positions would not fit (SGLang would otherwise abort it after
``create_req`` had extended the session's arrays).
"""

from __future__ import annotations

from array import array

EVICT_PARAM = "kvstreams_evict"  # sampling_params.custom_params key: a turn's eviction, flat [start, end, ...]


def pop_turn_eviction(recv_req) -> list | None:
    """The eviction a turn carries (``custom_params[EVICT_PARAM]``), taken out of its sampling parameters so
    that nothing downstream sees it; None when it carries none."""
    sampling = recv_req.sampling_params
    custom = getattr(sampling, "custom_params", None)
    if not isinstance(custom, dict) or EVICT_PARAM not in custom:
        return None
    rest = {k: v for k, v in custom.items() if k != EVICT_PARAM}
    sampling.custom_params = rest or None
    return custom[EVICT_PARAM]


def eviction_spans(flat) -> list[list[int]]:
    """``[start, end, start, end, ...]`` -> ``[[start, end], ...]`` (the values are checked by ``check_spans``)."""
    if not isinstance(flat, list) or len(flat) % 2:
        raise ValueError(f"custom_params.{EVICT_PARAM} must be a flat list [start, end, start, end, ...] of an even "
                         f"length, got {flat!r}")
    return [flat[i: i + 2] for i in range(0, len(flat), 2)]


def _last_req(session):
    if not session.req_nodes:
        return None
    [node] = session.req_nodes.values()
    return node.req


def session_tokens(session) -> array:
    """The stream's compacted tokens as its next turn will see them (a prefill-only turn's sampled token
    is not one of them)."""
    req = _last_req(session)
    if req is None:
        return array("q")
    return req.origin_input_ids[: session.committed_origin_len] + req.output_ids[: req.sampling_params.max_new_tokens]


def replace_session_tokens(session, tokens: array) -> None:
    """Make ``tokens`` the session's token list. The next turn extends these arrays in place after trimming
    them to the committed lengths: fresh arrays, committed at their full length."""
    req = _last_req(session)
    req.origin_input_ids = array("q", tokens)
    req.origin_input_ids_unpadded = array("q", tokens)
    req.full_untruncated_fill_ids = array("q", tokens)
    req.output_ids = array("q")
    session.committed_origin_len = session.committed_unpadded_len = session.committed_fill_len = len(tokens)


def ids_refusal(input_ids, vocab_size: int) -> str | None:
    """Why ``input_ids`` cannot run (ids outside ``[0, vocab_size)``), or None."""
    if input_ids is None or not len(input_ids):
        return None
    lo, hi = min(input_ids), max(input_ids)
    if lo < 0 or hi >= vocab_size:
        return f"kvstreams: input_ids must be token ids in [0, {vocab_size}), got {lo if lo < 0 else hi}"
    return None


def turn_refusal(session, state, recv_req, *, max_req_len: int, max_req_input_len: int,
                 context_len: int) -> str | None:
    """Why a stream's turn cannot run, or None. ``max_req_len``: SGLang's bound on one request's KV (the
    context length and the KV pool); ``context_len``: the model's, which bounds logical positions (RoPE)."""
    tokens = len(session_tokens(session))
    new = len(recv_req.input_ids)
    max_new = recv_req.sampling_params.max_new_tokens or 0
    kv = tokens + new + max_new
    if tokens + new >= max_req_input_len or kv >= max_req_len:
        return (f"kvstreams: this turn would hold {tokens} + {new} + {max_new} (max_new_tokens) = {kv} tokens of KV, "
                f"over this server's limit of {max_req_len - 1} per request (context length and KV pool); the "
                "session is unchanged: evict spans or send less")
    end = tokens + state.offset + new + max_new
    if end > context_len:
        return (f"kvstreams: this turn would reach position {end}, past the model's context length "
                f"{context_len}; the session is unchanged")
    return None

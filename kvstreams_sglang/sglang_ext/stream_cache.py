"""KV streams in SGLang's radix tree: ``KVStreamRadixCache``, a ``RadixCache`` with private branches.

A KV stream is a streaming session whose committed tokens live in the radix tree (page size 1).
Its token list (the session's arrays, compacted: evicted tokens removed) splits at the shared
prefix length ``p``: tokens ``[0, p)`` (the episode's first message, the same for the G GRPO
siblings of a task) are an ordinary untagged path, shared through the tree; tokens ``[p, n)`` form
a *private branch* whose first key element is the stream's tag, a negative int no token id can
equal. After an in-place eviction the branch no longer equals a standard prefill of its tokens
(kept tokens keep the positions, and were computed seeing the tokens now gone), so no other request
may ever match it: the tag guarantees that.

Between turns a stream holds no lock and no ``req_to_token`` row: all its KV is evictable tree KV,
so SGLang's admission counts it and memory pressure cannot deadlock. The cache's eviction takes a
private branch whole (``evict``): either a stream has all its KV or it lost its branch. A turn
arriving for a stream that lost KV it had computed (``match_prefix`` finds fewer tokens than the
stream computed) is aborted with ``STREAM_EVICTED``: re-prefilling the kept tokens alone would put
KV computed under another mask behind them; the client restores the stream exactly from its
ledger (``client``) and sends the turn again.

Every token is committed: when a turn finishes the tree holds all but its last sampled token; the
session's arrays end with it, so the next turn's extend computes it first, at its logical position,
after the eviction that turn carries (the client's ledger books it so: the trainer's mask then agrees).
Under overlap scheduling SGLang has often run one more decode step of a finished request (it schedules
one batch ahead), which computed that token's KV before the eviction: ``cache_finished_req`` frees it
(``committed_len``), so both schedulers leave the same stream. Positions: ``logical = compacted index +
offset`` for everything computed after the last eviction (``offset`` = tokens evicted so far);
``patches`` adds ``req.kvstreams_offset`` to ``ForwardBatch.positions``.

kv4rl (``KV4TokenToKVPool``): the pool keeps the INT8 copies of a sequence's sink and recent
positions in the side row of the request row it runs in, and a stream takes a new row every turn;
``side_rows.SideRows`` keeps an idle stream's side row and puts it back under its next row. GRPO
siblings share their prompt's compute when a first turn's input is exactly its shared prefix: once
such a turn is prefilled, its side row, which holds the prompt's INT8 copies as of the prompt's end
(under overlap scheduling, also a first decode step's copy at position ``p``, which nothing reads: a
turn writes a position's copy before it attends to it), is kept as the prompt's snapshot while any
stream of that prompt is open; a sibling's first turn then matches the prompt in the tree and starts
from the snapshot. A first turn longer than its shared prefix (e.g. a chat header after the first
message) computes the prompt in its own row: no row ever held the INT8 copies of the prompt's last
positions as of the prompt's end (the ring slots went to the turn's later tokens; the prompt's slots
are still shared, the tree keeps one copy), so the client (``client._Streams._share_prompt``) sends
such a turn's prefix first, on its own. Plain requests reuse no prefix.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from array import array
from http import HTTPStatus

import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from trainer_masks import EvictionError, check_spans

from . import STREAM_EVICTED
from .host_clock import HostClock, timed
from .sessions import replace_session_tokens, session_tokens

BACKEND_NAME = "kvstreams"  # --radix-cache-backend
OFFSET_ATTR = "kvstreams_offset"  # on a Req: the stream's position offset for this turn


@dataclasses.dataclass
class StreamState:
    """What the tree cache knows of one stream (one streaming session)."""

    session_id: str
    tag: int  # first key element of the private branch: negative, unique per stream
    extra_key: str | None  # the radix namespace of its shared prefix (the policy version at open)
    shared_prefix_len: int | None  # p; None: the first turn's input (fixed when the first turn arrives)
    prompt: array = dataclasses.field(default_factory=lambda: array("q"))  # tokens [0, p), fixed at the first turn
    live: list[int] = dataclasses.field(default_factory=list)  # logical positions of the tokens in the tree
    offset: int = 0  # tokens evicted so far: logical position = compacted index + offset after them
    prefix_hit_tokens: int = 0  # tokens of the first turn served from the tree
    side: dict | None = None  # kv4rl: the INT8 side row between turns (SideRows)
    prompt_counted: bool = False  # kv4rl: counted as an open stream of its prompt's side-row snapshot
    turn_rid: str | None = None  # the request id of its current turn (SGLang also hands refused requests the session)

    @property
    def computed(self) -> int:
        """Compacted tokens whose KV the stream has computed (kept in the tree unless the cache evicted it)."""
        return len(self.live)

    def key(self, token_ids) -> RadixKey:
        """The radix key of ``token_ids`` (the stream's compacted tokens from 0): untagged up to ``p``, then the
        private branch."""
        ids = array("q", token_ids)
        if self.shared_prefix_len is not None and len(ids) > self.shared_prefix_len:
            ids[self.shared_prefix_len] = self.tag
        return RadixKey(ids, self.extra_key)


class KVStreamRadixCache(RadixCache):
    """``RadixCache`` whose streaming sessions are KV streams (module docstring). Requests without a stream
    (plain requests, non-streaming sessions) take ``RadixCache``'s paths unchanged, except that under
    kv4rl they reuse no prefix."""

    def __init__(self, params, *, side_rows=None):
        self.streams: dict[str, StreamState] = {}
        self._by_tag: dict[int, StreamState] = {}
        self._tags = itertools.count(1)
        self.side_rows = side_rows  # kv4rl only
        # kv4rl: (namespace, prompt) -> the side row right after that prompt's prefill, and the open streams of it
        self.prompt_sides: dict[tuple, dict] = {}
        self.prompt_streams: dict[tuple, int] = {}
        # a shared prefix not in the tree yet -> the first turn computing it (patches' sibling deferral)
        self.prompts_in_flight: dict[tuple, object] = {}
        self.counters = dict(prefix_hit_tokens=0, branches_evicted=0, turns_aborted_evicted=0)
        self.host_clock = HostClock()  # the scheduler's host time in the hooks below (/kvstreams/host_clock)
        super().__init__(params)

    # ---- streams ----
    def supports_streaming_session(self) -> bool:
        return True  # SGLang must not wrap us in its pinning StreamingSession

    def open_stream(self, session_id: str, shared_prefix_len: int | None, extra_key: str | None) -> StreamState:
        if session_id in self.streams:
            raise EvictionError(f"session {session_id!r} is already a stream")
        if shared_prefix_len is not None and shared_prefix_len < 0:
            raise EvictionError(f"shared_prefix_len must be >= 0, got {shared_prefix_len}")
        state = StreamState(session_id, -next(self._tags), extra_key, shared_prefix_len)
        if self.side_rows is not None:
            state.side = self.side_rows.empty()
        self.streams[session_id] = self._by_tag[state.tag] = state
        return state

    def stream_of(self, req) -> StreamState | None:
        """The stream a request is the current turn of, or None."""
        session = getattr(req, "session", None) if req is not None else None
        if session is None or not session.streaming:
            return None
        state = self.streams.get(session.session_id)
        return state if state is not None and req.rid == state.turn_rid else None

    @timed("begin_turn")
    def begin_turn(self, session, recv_req) -> StreamState:
        """A turn of an idle streaming session arrived (before SGLang builds its request): the stream, opened
        here if the session was opened without ``kvstreams_open``; its first turn fixes the shared prefix."""
        state = self.streams.get(session.session_id) or self.open_stream(session.session_id, None, recv_req.extra_key)
        input_ids = recv_req.input_ids
        if not state.computed:
            p = len(input_ids) if state.shared_prefix_len is None else min(state.shared_prefix_len, len(input_ids))
            state.shared_prefix_len = p
            state.prompt = array("q", input_ids[:p])
            session._strip_bos_token = _keep_every_token
        state.turn_rid = recv_req.rid
        return state

    def release_session(self, session_id: str) -> None:
        """Session close: the stream's private branch leaves the tree (its shared prefix stays, as cache)."""
        state = self.streams.pop(session_id, None)
        if state is None:
            return
        self._forget_prompt(state)
        key = self._prompt_key(state)
        other = self.prompts_in_flight.get(key)
        if other is not None and other.rid == state.turn_rid:  # its first turn, cut short
            del self.prompts_in_flight[key]
        del self._by_tag[state.tag]
        branch = self._find_branch(state)
        if branch is not None and not _any_locked(branch):  # (locked: a turn still runs; the cache evicts it later)
            self._delete_subtree(branch)

    # ---- SGLang's request paths ----
    @timed("match_prefix")
    def match_prefix(self, params: MatchPrefixParams):
        req = params.req
        state = self.stream_of(req)
        if state is None:
            if req is not None and self.side_rows is not None:
                return self._empty_match_result  # kv4rl: a row holds the INT8 copies only of what it computed
            return super().match_prefix(params)
        if req.to_finish is not None:  # refused by SGLang before it ran: not a turn of the stream
            req.session.abort_req()
            req.session = None
            return self._empty_match_result
        key = state.key(params.key.raw_token_ids())
        result = super().match_prefix(dataclasses.replace(params, key=key))
        if len(result.device_indices) < min(state.computed, len(key)):
            self._abort_evicted(req)
            return self._empty_match_result
        setattr(req, OFFSET_ATTR, state.offset)
        if self.side_rows is not None and not state.computed:
            if self._prompt_key(state) not in self.prompt_sides:
                return self._empty_match_result  # kv4rl: the first turn writes its prompt's INT8 copies in its row
            self._count_prompt(state)  # the snapshot stays while this stream is open (it loads it before its extend)
        return result

    @timed("cache_unfinished_req")
    def cache_unfinished_req(self, req, chunked=False):
        state = self.stream_of(req)
        if state is None:
            return super().cache_unfinished_req(req, chunked=chunked)
        # RadixCache.cache_unfinished_req with the stream's key: insert, free duplicates, re-point the row
        token_ids = req.get_fill_ids()
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)]
        key = state.key(token_ids)
        result = self.insert(InsertParams(key=key, value=row.to(torch.int64, copy=True), chunked=chunked,
                                          priority=getattr(req, "priority", 0) or 0))
        self._split_at_prefix(state, key)
        self.token_to_kv_pool_allocator.free_segment(row[req.cache_protected_len: result.prefix_len],
                                                     start_pos=req.cache_protected_len)
        match = super().match_prefix(MatchPrefixParams(key=key))
        indices, node = match.device_indices, match.last_device_node
        assert len(indices) == len(key), f"{len(indices)=}, {len(key)=}"
        self.req_to_token_pool.write((req.req_pool_idx, slice(req.cache_protected_len, len(indices))),
                                     indices[req.cache_protected_len:])
        req.cache_protected_len = len(indices)
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(node)
        req.prefix_indices = indices
        req.last_node = node
        if not chunked:
            self._snapshot_prompt(state, req)
            self._prefill_cached(state, req)

    @timed("cache_finished_req")
    def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
        state = self.stream_of(req)
        if state is None:
            return super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
        session = req.session
        if not req.finished():  # retracted (decode ran out of KV): its turn resumes later, from a new row
            self._save_side(state, req)
            return super().cache_finished_req(req, is_insert=False, kv_len_to_handle=kv_len_to_handle)
        if isinstance(req.finished_reason, FINISH_ABORT):  # mid-turn abort: the stream stays as it was
            super().cache_finished_req(req, is_insert=False, kv_len_to_handle=kv_len_to_handle)
            self._prune(state, session_tokens(session))
            session.abort_req()
            return
        n = min(kv_len_to_handle, committed_len(req))
        token_ids = (req.origin_input_ids + req.output_ids)[:n]
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx, : kv_len_to_handle]
        key = state.key(token_ids)
        result = self.insert(InsertParams(key=key, value=row[:n].to(torch.int64, copy=True),
                                          priority=getattr(req, "priority", 0) or 0))
        self._split_at_prefix(state, key)
        self.token_to_kv_pool_allocator.free_segments([(row[req.cache_protected_len: result.prefix_len],
                                                        req.cache_protected_len), (row[n:], n)])
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        self._snapshot_prompt(state, req)
        if not state.computed:
            state.prefix_hit_tokens = int(req.cached_tokens)
            self.counters["prefix_hit_tokens"] += state.prefix_hit_tokens
        state.live.extend(range(state.computed + state.offset, len(token_ids) + state.offset))
        self._prefill_cached(state, req)
        self._save_side(state, req)
        session.finish_req(req)
        self._merge_branch(state, session_tokens(session))

    @timed("evict")
    def evict(self, params: EvictParams) -> EvictResult:
        """``RadixCache.evict`` (leaves by the eviction policy, plain cache before private branches), except
        that a private branch leaves whole: a stream keeps all its KV or none of it."""
        start = time.perf_counter()
        heap = [(self._evict_priority(node), node) for node in self.evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        while evicted < params.num_tokens and heap:
            _, node = heapq.heappop(heap)
            if node.parent is None or node.parent.children.get(node.key.child_key(self.page_size)) is not node:
                continue  # left with its branch
            branch = self._private_root(node)
            if branch is not None and not _any_locked(branch):
                parent = branch.parent
                evicted += self._delete_subtree(branch)
                self.counters["branches_evicted"] += 1
            else:
                parent = node.parent
                evicted += self._delete_subtree(node)
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (self._evict_priority(parent), parent))
        self.update_eviction_metrics(evicted, start)
        return EvictResult(num_tokens_evicted=evicted)

    # ---- in-place span eviction (between turns) ----
    @timed("evict_spans")
    def evict_spans(self, session, spans) -> int:
        """Evict ``spans`` (``[start, end)`` logical positions) of a stream in place: validated against the
        server's view with ``trainer_masks.check_spans``; spans inside the shared prefix are refused (its KV is
        shared: copy-on-write is future work). Frees exactly the dropped slots of the private branch and
        removes the tokens from the session's arrays. A stream whose branch the cache evicted is edited only
        logically (its next turn is aborted for a restore). Returns the number of tokens evicted. No device
        sync: a turn's eviction runs in the scheduler step that admits it, while the previous batch runs on
        the GPU (``info``, which copies the slots to the host, is for the RPC route)."""
        state = self._idle_stream(session)
        tokens = session_tokens(session)
        eviction = check_spans(spans, live=state.live, num_computed=state.computed + state.offset,
                               end=len(tokens) + state.offset, name=f"session {session.session_id!r}")
        p = state.shared_prefix_len
        for start, stop in eviction.spans:
            if start < p:
                raise EvictionError(
                    f"session {session.session_id!r}: span [{start}, {stop}) reaches into the shared prefix [0, {p}), "
                    "whose KV other streams share (open the stream with a smaller shared_prefix_len to evict it)")
        runs = index_runs(eviction.dropped)
        n = sum(hi - lo for lo, hi in runs)
        chain = self._prune(state, tokens)
        kept = without_runs(tokens, runs)
        if chain is not None:
            self._compact(state, chain, kept[: state.computed - n], runs)
        replace_session_tokens(session, kept)
        state.live = without_runs(state.live, runs)
        state.offset += n
        return n

    def info(self, session) -> dict:
        """A stream as the server holds it: ``live_tokens`` (computed tokens), their ``slots`` and logical
        ``positions``, ``evicted_tokens`` (the position offset), ``stream_length`` (the next logical position
        after its pending tokens), ``shared_prefix_len``, ``lost`` (the cache evicted KV it computed)."""
        state = self._stream(session)
        tokens = session_tokens(session)
        slots = self._slots(state, tokens[: state.computed])
        return dict(session_id=session.session_id, live_tokens=state.computed, evicted_tokens=state.offset,
                    stream_length=len(tokens) + state.offset, shared_prefix_len=state.shared_prefix_len,
                    slots=slots.tolist() if slots is not None else [], positions=list(state.live),
                    lost=slots is None, prefix_hit_tokens=state.prefix_hit_tokens)

    def stream_tokens(self) -> int:
        """Tokens held by open streams' private branches."""
        total = 0
        for state in self.streams.values():
            branch = self._find_branch(state)
            total += _subtree_size(branch) if branch is not None else 0
        return total

    def unshared_prompt(self, req):
        """For a stream's first turn whose shared prefix is not in the tree yet: the prefix's identity
        (namespace, tokens), which its GRPO siblings share; else None. ``patches`` holds a sibling back one
        prefill round so that it finds the prefix in the tree instead of computing it again."""
        state = self.stream_of(req)
        if state is None or state.computed or not state.shared_prefix_len:
            return None
        if len(req.prefix_indices) >= min(state.shared_prefix_len, len(req.full_untruncated_fill_ids) - 1):
            return None
        return self._prompt_key(state)

    def prompt_in_flight(self, prompt: tuple, req) -> bool:
        """Whether another first turn is computing the shared prefix ``prompt`` (``unshared_prompt``): it was
        scheduled and its prefill is not cached yet (``_prefill_cached``). A sibling waits for it rather than
        compute the prefix again."""
        other = self.prompts_in_flight.get(prompt)
        if other is None or other is req:
            return False
        if other.finished() or other.session is None:  # aborted or dropped before its prefill was cached
            del self.prompts_in_flight[prompt]
            return False
        return True

    def _prefill_cached(self, state: StreamState, req) -> None:
        """``req``'s prefill is in the tree: its siblings may match its shared prefix."""
        key = self._prompt_key(state)
        if self.prompts_in_flight.get(key) is req:
            del self.prompts_in_flight[key]

    # ---- kv4rl side rows ----
    @timed("load_side_rows")
    def load_side_rows(self, reqs) -> None:
        """Before an extend: put each stream's saved INT8 side row under the row its turn runs in (once per row); a
        first turn that matched its prompt in the tree starts from the prompt's snapshot."""
        if self.side_rows is None:
            return
        for req in reqs:
            state = self.stream_of(req)
            if state is not None and getattr(req, "kvstreams_side_row", None) != req.req_pool_idx:
                side = state.side
                if not state.computed and len(req.prefix_indices):
                    side = self.prompt_sides.get(self._prompt_key(state), side)
                self.side_rows.load(side, req.req_pool_idx)
                req.kvstreams_side_row = req.req_pool_idx

    @staticmethod
    def _prompt_key(state: StreamState) -> tuple:
        """A shared prefix's identity: its radix namespace and its tokens."""
        return state.extra_key, state.prompt.tobytes()

    def _count_prompt(self, state: StreamState) -> None:
        """``state`` is one of the open streams that keep its prompt's snapshot (once)."""
        if not state.prompt_counted:
            key = self._prompt_key(state)
            self.prompt_streams[key] = self.prompt_streams.get(key, 0) + 1
            state.prompt_counted = True

    def _snapshot_prompt(self, state: StreamState, req) -> None:
        """After a first turn's prefill, when its input is exactly the shared prefix: its side row becomes the
        prompt's snapshot for the siblings (taken once), and the stream counts as one of the prompt's."""
        if self.side_rows is None or state.computed or state.prompt_counted:
            return
        if (not state.shared_prefix_len or len(req.origin_input_ids) != state.shared_prefix_len
                or len(req.output_ids) > 1):  # (a decode step has written its token's INT8 copy since)
            return
        key = self._prompt_key(state)
        if key not in self.prompt_sides:
            snapshot = self.side_rows.empty()
            self.side_rows.save(snapshot, req.req_pool_idx)
            self.prompt_sides[key] = snapshot
        self._count_prompt(state)

    def _forget_prompt(self, state: StreamState) -> None:
        if not state.prompt_counted:
            return
        key = self._prompt_key(state)
        self.prompt_streams[key] -= 1
        if not self.prompt_streams[key]:
            del self.prompt_streams[key], self.prompt_sides[key]

    def _save_side(self, state: StreamState, req) -> None:
        if self.side_rows is not None:
            self.side_rows.save(state.side, req.req_pool_idx)
            req.kvstreams_side_row = None

    # ---- helpers ----
    def _stream(self, session) -> StreamState:
        state = self.streams.get(session.session_id)
        if state is None:
            raise EvictionError(f"session {session.session_id!r} is not a KV stream (open it with "
                                "/kvstreams/open, or take a turn on a streaming session first)")
        return state

    def _idle_stream(self, session) -> StreamState:
        state = self._stream(session)
        if session._inflight:
            raise EvictionError(f"session {session.session_id!r} is generating; evict between turns")
        if not state.computed:
            raise EvictionError(f"session {session.session_id!r} holds no KV yet: run a turn first")
        return state

    def _abort_evicted(self, req) -> None:
        """Abort a turn of a stream whose KV the cache evicted; SGLang then runs it as a one-token request.
        The session's arrays (shared with its last turn) are left alone."""
        self.counters["turns_aborted_evicted"] += 1
        req.session.abort_req()
        req.session = None
        req.origin_input_ids = req.origin_input_ids_unpadded = array("q", [0])
        req.full_untruncated_fill_ids = array("q", [0])
        req.return_logprob = False
        req.logprob_start_len = -1
        req.to_finish = FINISH_ABORT(STREAM_EVICTED + ": restore it from its ledger and send the turn again",
                                     HTTPStatus.CONFLICT, "KVStreamEvicted")

    def _split_at_prefix(self, state: StreamState, key: RadixKey) -> None:
        """Keep a node boundary at ``p``: the private branch must be a child of the shared prefix (an insert into a
        tree without the prefix makes one node of both)."""
        p = state.shared_prefix_len
        if 0 < p < len(key):
            self._match_prefix_helper(self.root_node, key[:p])

    def _branch_key(self, state: StreamState):
        return state.tag if state.extra_key is None else (state.extra_key, state.tag)

    def _find_branch(self, state: StreamState) -> TreeNode | None:
        """The first node of the stream's private branch, or None; read-only."""
        node, key = self.root_node, RadixKey(state.prompt, state.extra_key)
        while len(key):
            child = node.children.get(key.child_key(self.page_size))
            if child is None or child.key.match(key, page_size=self.page_size) < len(child.key):
                return None  # a branch hangs off a node boundary at p
            node, key = child, key[len(child.key):]
        return node.children.get(self._branch_key(state))

    def _slots(self, state: StreamState, token_ids) -> torch.Tensor | None:
        """Slots of ``token_ids`` (the stream's computed tokens) in the tree, None if the cache evicted some;
        read-only."""
        node, key, values = self.root_node, state.key(token_ids), []
        while len(key):
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                return None
            n = child.key.match(key, page_size=self.page_size)
            values.append(child.value[:n])
            node, key = child, key[n:]
            if n < len(child.key) and len(key):
                return None
        return torch.cat(values) if values else torch.empty(0, dtype=torch.int64)

    def _prune(self, state: StreamState, tokens) -> list[TreeNode] | None:
        """Make the private branch exactly the stream's computed tokens: nodes off that path (a turn aborted
        after its prefill was inserted) leave the tree. Returns the branch's node chain ([] when no private
        token is computed), or None and drops what is left of the branch if the cache evicted part of it."""
        p, n = state.shared_prefix_len, state.computed
        values, last = self._match_prefix_helper(self.root_node, state.key(tokens[:n])) if n else ([], None)
        if sum(len(v) for v in values) < n:
            branch = self._find_branch(state)
            if branch is not None:
                self._delete_subtree(branch)
            return None
        chain, size, node = [], 0, last
        while size < n - p:  # up from the last computed token to the branch's first node (at p: _split_at_prefix)
            chain.append(node)
            size += len(node.key)
            node = node.parent
        assert size == n - p and (not chain or chain[-1].key.token_ids[0] == state.tag), "malformed private branch"
        chain.reverse()
        on_path = set(map(id, chain))
        if not chain:  # nothing private computed: the whole branch is off the path
            branch = self._find_branch(state)
            if branch is not None:
                self._delete_subtree(branch)
        for node in chain:
            for child in list(node.children.values()):
                if id(child) not in on_path:
                    self._delete_subtree(child)
        return chain

    def _merge_branch(self, state: StreamState, tokens) -> None:
        """After a turn: the private branch as one node again. Each turn's insert hangs a node under it, and every
        tree walk (``match_prefix``, ``insert``) copies the rest of its key at each node, so without evictions
        (which compact the branch) a stream's tree work per turn grew with turns x tokens (``bench.stream_cache_cost
        --growth``). Nothing else may match inside a private branch, so its node boundaries mean nothing. A branch
        of two nodes stays: a turn that evicts compacts it anyway (Sliding Window's every turn), so a stream that
        never evicts merges every other turn and its walks pass at most three nodes."""
        chain = self._prune(state, tokens)
        if chain is not None and len(chain) > 2 and not any(node.lock_ref for node in chain):
            self._compact(state, chain, tokens[: state.computed], [])

    def _compact(self, state: StreamState, chain: list[TreeNode], kept, runs: list[tuple[int, int]]) -> None:
        """Rewrite the branch ``chain`` (compacted tokens [p, computed)) as one node holding ``kept[p:]``: the
        slots of the compacted index ``runs`` are freed, every other slot stays where it is. Slices only: no
        per-token host work and no host sync (the slots stay on the device)."""
        if not chain:
            return
        p = state.shared_prefix_len
        first, parent = chain[0], chain[0].parent
        values = torch.cat([node.value for node in chain])
        runs = [(lo - p, hi - p) for lo, hi in runs]  # into values
        for node in chain:
            self._record_remove_event(node)
            self.evictable_leaves.discard(node)
        if runs:
            self.token_to_kv_pool_allocator.free(torch.cat([values[lo:hi] for lo, hi in runs]))
        self.evictable_size_ -= sum(hi - lo for lo, hi in runs)
        keep = [values[a:b] for a, b in kept_runs(runs, len(values))]
        if not keep:
            del parent.children[self._branch_key(state)]
            self._update_leaf_status(parent)
            return
        first.key = state.key(kept)[p:]
        first.value = torch.cat(keep)
        first.children = {}
        first.hash_value = None
        self._update_leaf_status(first)
        self._record_store_event(first)

    def _private_root(self, node: TreeNode) -> TreeNode | None:
        """The first node of the private branch ``node`` is in, or None for shared/plain nodes."""
        while node is not self.root_node:
            if node.key.token_ids[0] < 0:
                return node
            node = node.parent
        return None

    def _evict_priority(self, node: TreeNode):
        return self._private_root(node) is not None, self.eviction_strategy.get_priority(node)

    def _delete_subtree(self, node: TreeNode) -> int:
        """Remove ``node`` and everything below it from the tree and free their slots (all unlocked)."""
        freed = 0
        for child in list(node.children.values()):
            freed += self._delete_subtree(child)
        assert node.lock_ref == 0, "deleting a locked radix node"
        self.token_to_kv_pool_allocator.free(node.value)
        freed += len(node.value)
        self._delete_leaf(node)
        self._record_remove_event(node)
        return freed


def committed_len(req) -> int:
    """The tokens of a finished turn its stream keeps computed: its input and every sampled token but the last
    (a prefill-only turn's sampled token is not one of the stream's)."""
    return len(req.origin_input_ids) + max(len(req.output_ids[: req.sampling_params.max_new_tokens]) - 1, 0)


def _keep_every_token(req, tokenizer) -> None:
    """A KV stream keeps every token it is sent: SGLang drops a leading BOS of an appended turn
    (``Session._strip_bos_token``), which would desynchronise the stream from its ledger."""


def index_runs(indices) -> list[tuple[int, int]]:
    """Ascending distinct indices as ``[lo, hi)`` runs of consecutive ones (an eviction drops whole spans: a
    run each)."""
    runs: list[tuple[int, int]] = []
    for i in indices:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def kept_runs(runs: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """The non-empty ``[lo, hi)`` runs of ``range(n)`` between the dropped ``runs``."""
    out, prev = [], 0
    for lo, hi in runs:
        if lo > prev:
            out.append((prev, lo))
        prev = hi
    if n > prev:
        out.append((prev, n))
    return out


def without_runs(seq, runs: list[tuple[int, int]]):
    """``seq`` (a list or an array) without the index ``runs``, by slices."""
    out = seq[:0]
    for lo, hi in kept_runs(runs, len(seq)):
        out += seq[lo:hi]
    return out


def _any_locked(node: TreeNode) -> bool:
    return node.lock_ref > 0 or any(_any_locked(c) for c in node.children.values())


def _subtree_size(node: TreeNode) -> int:
    return len(node.value) + sum(_subtree_size(c) for c in node.children.values())


def make_stream_cache(ctx) -> KVStreamRadixCache:
    """The ``--radix-cache-backend kvstreams`` factory: refuses the models and caches streams cannot live in."""
    from sglang.srt.configs.model_config import AttentionArch

    reasons = [(ctx.is_hybrid_swa, "sliding-window (hybrid SWA) models"),
               (ctx.is_hybrid_ssm, "hybrid SSM/Mamba models"), (ctx.is_dsa, "DSA models"),
               (ctx.model_config.attention_arch == AttentionArch.MLA, "MLA models"),
               (ctx.enable_hierarchical_cache, "the hierarchical cache"),
               (ctx.params.disable, "a disabled radix cache (multimodal models on the Transformers backend)")]
    for refused, what in reasons:
        if refused:
            raise ValueError(f"--enable-kv-streams does not support {what}")
    kvcache = ctx.params.token_to_kv_pool_allocator.get_kvcache()
    side_rows = None
    if hasattr(kvcache, "sink") and hasattr(kvcache, "layer_cache"):  # the kv4rl pool (pool.KV4TokenToKVPool)
        from .side_rows import SideRows

        side_rows = SideRows(kvcache)
    return KVStreamRadixCache(ctx.params, side_rows=side_rows)


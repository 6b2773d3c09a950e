"""The built-in engine: KV streams + continuous batching on a Hugging Face model.

Used where SGLang cannot run (CPU, tests, demos) and as the reference for it. Verbs on a
stream: ``open_stream`` / ``append`` (tokens become pending; they are prefilled lazily
with the next generation, in one extend), ``generate`` (sync, one or many streams) /
``agenerate`` (asyncio; all waiting streams are batched together), ``evict`` (in place,
nothing re-prefilled), ``close``; and ``update_weights`` (no KV flush, bumps the policy
version stamped on every sampled token), optionally followed by ``reprefill`` (recompute the
kept KV under the new weights, as KV4-RL does). Scheduling follows nano-vllm: a step is either
an extend of every stream with several pending tokens, or a decode of every stream with
exactly one.

Faults stay with the request that caused them. Token ids are checked where they enter
(``open_stream``, ``append``, forced tokens); a step first fails the requests that cannot run
(their slots do not fit, their stream would outgrow ``max_context``) and only then allocates;
a forward that raises is undone (slots freed, slot-table rows and overwritten INT8 side
entries restored, ledgers untouched) and the requests that fail alone get the exception,
while the others run on exactly as they would have without them.
"""

from __future__ import annotations

import asyncio
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import ValidationError

from trainer_masks import StreamLedger

from ..streams import ContextLengthError, FullPrecisionPool, KV4Pool, KVStream, OutOfSlotsError, SlotTable, StreamTable
from .attention import FullPrecisionBackend, KV4Backend
from .batch import StepItem, build_replay_batch
from .config import EngineConfig
from .model_runner import ModelRunner
from .replay import replay
from .sampling import SamplingParams, sample_batch


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"] = "length"


@dataclass
class EngineStats:
    live_slots: int = 0
    peak_slots: int = 0
    tokens_prefilled: int = 0  # tokens computed in extend steps (prompts, observations, summaries' context)
    tokens_decoded: int = 0  # tokens computed in decode steps
    tokens_in_streams: int = 0  # sum over streams (open or closed) of tokens whose KV was computed
    steps: int = 0
    evicted_tokens: int = 0
    tokens_reprefilled_on_update: int = 0  # tokens run again by ``Engine.reprefill`` (evicted ones included)

    @property
    def tokens_reprefilled(self) -> int:
        """Forward passes beyond one per stream token. Extends and decodes compute each stream
        token once, so this is 0 by construction of KV streams unless ``Engine.reprefill`` was
        asked to recompute kept KV under new weights: then it counts every token that replay ran
        (``tokens_reprefilled_on_update``)."""
        return self.tokens_prefilled + self.tokens_decoded + self.tokens_reprefilled_on_update - self.tokens_in_streams


@dataclass(frozen=True)
class StepInfo:
    """One scheduler step, as an ``Engine.on_step`` observer sees it (benchmarks time steps with it)."""

    mode: Literal["extend", "decode"]
    streams: int  # streams whose tokens the step computed
    tokens: int  # tokens computed
    seconds: float  # wall time (a step that samples ends by copying its tokens to the host: device time too)
    live_slots: int  # KV slots in use after the step
    max_stream_slots: int  # the most KV slots one of the step's streams holds after it


@dataclass
class _Request:
    sid: int
    params: SamplingParams | None  # None: prefill the pending tokens, sample nothing
    generator: torch.Generator | None
    out: Generation = field(default_factory=lambda: Generation([], []))
    done: bool = False
    error: BaseException | None = None  # why it failed (done, nothing more will be sampled)
    future: asyncio.Future | None = None

    @property
    def forced_token(self) -> int | None:
        forced = self.params.forced_token_ids if self.params is not None else ()
        return forced[len(self.out.token_ids)] if forced else None


@dataclass
class _Planned:
    """A request scheduled into a step: its stream and how many pending tokens it computes."""

    req: _Request
    stream: KVStream
    num_new: int


@dataclass
class _Undo:
    """What a step changed before its forward: the slot-table rows' lengths before it, the
    slots it took, what the backend saved of the storage it overwrites."""

    rows: list[int]
    lengths: list[int]
    items: list[StepItem] = field(default_factory=list)
    saved: object | None = None


class Engine:
    """``model_path`` loads a checkpoint; ``model=`` runs an already-loaded Hugging Face model instead (several
    engines, e.g. with different pools, can share one). ``on_step`` is called after every scheduler step with
    its ``StepInfo``."""

    @classmethod
    def from_config(cls, model_path: str | None, config: EngineConfig, *, device="cpu",
                    dtype: torch.dtype | None = None, **kw) -> Engine:
        """An engine with ``config``'s settings (the harness's ``[inference]`` section is one)."""
        fields = {k: getattr(config, k) for k in EngineConfig.model_fields}
        return cls(model_path, device=device, dtype=dtype, **fields, **kw)

    def __init__(self, model_path: str | None = None, *, model=None, kv_dtype: Literal["bf16", "kv4rl"] = "bf16",
                 device="cpu", dtype: torch.dtype | None = None, kv_slots: int = 65536, max_streams: int = 256,
                 sink: int = 16, recent: int = 128, max_prefill_tokens: int = 16384,
                 max_context: int | None = None, batch_invariant: bool = False,
                 on_step: Callable[[StepInfo], None] | None = None):
        try:  # the settings' one validation (the same as a run's [inference] section gets)
            EngineConfig(kv_dtype=kv_dtype, kv_slots=kv_slots, max_streams=max_streams, sink=sink, recent=recent,
                         max_prefill_tokens=max_prefill_tokens, max_context=max_context,
                         batch_invariant=batch_invariant)
        except ValidationError as e:
            raise ValueError(f"Engine: {'; '.join(err['msg'] for err in e.errors())}") from None
        self.device = torch.device(device)
        self.runner = ModelRunner(model_path, model=model, device=self.device, dtype=dtype,
                                  batch_invariant=batch_invariant)
        r = self.runner
        self.kv_dtype = kv_dtype
        if kv_dtype == "kv4rl":
            pool = KV4Pool(r.num_layers, kv_slots, max_streams, r.num_kv_heads, r.head_dim, sink=sink,
                           recent=recent, device=self.device)
            self.backend = KV4Backend(pool, num_q_heads=r.num_heads, max_streams=max_streams,
                                      invariant=batch_invariant)
        else:
            pool = FullPrecisionPool(r.num_layers, kv_slots, r.num_kv_heads, r.head_dim, dtype=r.dtype,
                                     device=self.device)
            self.backend = FullPrecisionBackend(pool, invariant=batch_invariant,
                                                 gqa_group=r.num_heads // r.num_kv_heads)
        self.pool = pool
        self.table = StreamTable(kv_slots, max_streams)
        self.slot_table = SlotTable(max_streams, max_context or min(kv_slots, 65536), self.device)
        self.max_prefill_tokens = max_prefill_tokens
        self.vocab_size = r.vocab_size
        self.policy_version = 0
        self.stats = EngineStats()
        self._requests: dict[int, _Request] = {}
        self._loop_task: asyncio.Task | None = None
        self.on_step = on_step

    # ---- stream verbs ----
    def open_stream(self, stream: list[int] | StreamLedger) -> int:
        """A new stream on ``stream``'s tokens (pending: prefilled with the first generation). A
        ``StreamLedger`` is adopted as the stream's ledger, and stays the caller's view of it."""
        ids = stream.token_ids if isinstance(stream, StreamLedger) else stream
        if not ids:
            raise ValueError("open_stream needs at least one token")
        checked = self._token_ids(ids, "open_stream")
        return self.table.open(stream if isinstance(stream, StreamLedger) else checked).sid

    def append(self, sid: int, token_ids: list[int], *, source: Literal["env", "prompt"] = "env") -> None:
        self._idle(sid, "append to")
        self.table.get(sid).ledger.append(self._token_ids(token_ids, f"stream {sid}"), source)

    def evict(self, sid: int, spans) -> int:
        """Free the KV of ``spans`` (``[start, end)`` stream positions) in place; returns the
        number of tokens evicted. Invalid spans raise and change nothing."""
        self._idle(sid, "evict from")
        n = self.table.evict(sid, spans)
        st = self.table.get(sid)
        self.slot_table.rewrite(st.row, st.slots, st.positions)
        self.stats.evicted_tokens += n
        self._update_slot_stats()
        return n

    def close(self, sid: int) -> None:
        self._idle(sid, "close")
        self.slot_table.clear(self.table.close(sid).row)
        self._update_slot_stats()

    def stream_record(self, sid: int, **meta):
        return self.table.get(sid).ledger.to_record(kv_dtype=self.kv_dtype, **meta)

    def ledger(self, sid: int) -> StreamLedger:
        return self.table.get(sid).ledger

    def live_tokens(self, sid: int) -> int:
        return self.table.get(sid).ledger.num_live

    def update_weights(self, state_dict: dict[str, torch.Tensor], *, version: int | None = None) -> int:
        """Swap weights in place; every stream keeps its KV. Returns the new policy version."""
        self.runner.update_weights(state_dict)
        self.policy_version = self.policy_version + 1 if version is None else version
        return self.policy_version

    def reprefill(self, sids: list[int] | None = None,
                  *, impl: Literal["auto", "sdpa", "flex", "invariant"] = "auto") -> int:
        """Recompute the kept KV of streams with the current weights, in place (KV4-RL's
        re-prefill of carried prefixes after a weight update). Returns the number of tokens run.

        Each stream's computed tokens ``[0, num_computed)`` -- evicted ones included, at their
        original positions -- go through one forward under the trainer's eviction mask
        ``k <= q < death[k]`` (``trainer_masks``: SDPA + dense mask on CPU, FlexAttention on CUDA
        with ``impl="auto"``; the batch-invariant kernels on a ``batch_invariant`` engine, whose
        recomputed KV is then the trainer's bit for bit), since a kept token's KV depends on
        every token that was alive when it was written. Only the still-resident tokens' K/V is
        written, into the slots they already own (same positions; KV4: INT4 codes and, for sink /
        most recent positions, the INT8 side copies). Afterwards the engine's KV equals what the trainer's replay of the
        stream under the current weights computes. Slots, positions, eviction history, sampled
        logprobs and versions are unchanged; pending tokens (appended, or the last sampled one)
        stay pending and are computed by the next step. Several streams are packed into one
        forward up to ``max_prefill_tokens`` tokens.

        ``sids``: streams to recompute (default: every open stream). A stream with a generation
        in flight is included: this runs between scheduler steps (call it from the thread that
        drives the engine, like ``update_weights``), and its request only holds pending tokens.
        Unknown sids raise ``KeyError`` before anything changes.

        The count -- every token run, evicted ones included, so ``sum(num_computed)`` -- is added
        to ``stats.tokens_reprefilled_on_update`` and thereby to ``stats.tokens_reprefilled``.
        """
        if sids is None:
            streams = list(self.table.streams.values())
        else:
            if isinstance(sids, int):
                raise TypeError("reprefill takes a list of stream ids (or None for every open stream)")
            unknown = [s for s in sids if s not in self.table.streams]
            if unknown:
                raise KeyError(f"reprefill: no open stream {unknown[0]}" + (f" (unknown: {unknown})"
                                                                           if len(unknown) > 1 else ""))
            streams = [self.table.get(s) for s in dict.fromkeys(sids)]
        packs: list[list] = []  # streams packed into one forward, up to max_prefill_tokens
        for st in (st for st in streams if st.ledger.num_computed > 0):
            computed = sum(p.ledger.num_computed for p in packs[-1]) if packs else 0
            if not packs or computed + st.ledger.num_computed > self.max_prefill_tokens:
                packs.append([])
            packs[-1].append(st)
        total = 0
        r = self.runner
        if impl == "auto" and r.batch_invariant:
            impl = "invariant"
        for pack in packs:
            replay(r.model, self.pool, build_replay_batch(pack, self.device, impl=impl, pool=self.pool,
                                                          gqa_group=r.num_heads // r.num_kv_heads))
            n = sum(st.ledger.num_computed for st in pack)
            self.stats.tokens_reprefilled_on_update += n
            total += n
        return total

    # ---- generation ----
    def generate(self, sid: int, *, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, stop_token_ids=(), seed: int | None = None, forced_token_ids=()) -> Generation:
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, tuple(stop_token_ids), seed,
                                tuple(forced_token_ids))
        return self.generate_many([(sid, params)])[0]

    def generate_many(self, requests: list[tuple[int, SamplingParams]], *,
                      return_exceptions: bool = False) -> list[Generation]:
        """Generate for several streams at once (continuous batching). A request that fails (its
        stream outgrows the pool or ``max_context``, its forward raises) stops there and the
        others run to their end; then the first failure is raised, or, with
        ``return_exceptions``, returned in that request's place (as ``asyncio.gather`` does). A
        failed stream keeps what earlier steps sampled and can be evicted, appended to, generated
        from again or closed."""
        self._sync_only("agenerate")
        reqs = []
        try:
            for sid, params in requests:
                reqs.append(self._submit(sid, params))
            while not all(r.done for r in reqs):
                self.step()
        except BaseException as e:  # a bad request list, or interrupted: leave no request behind
            for r in reqs:
                if not r.done:
                    self._fail(r, e)
            raise
        if return_exceptions:
            return [r.error if r.error is not None else r.out for r in reqs]
        for r in reqs:
            if r.error is not None:
                raise r.error
        return [r.out for r in reqs]

    def prefill(self, sid: int) -> None:
        """Compute the KV of every pending token now, sampling nothing (e.g. so that a
        just-written exchange can be evicted before the next turn)."""
        self._sync_only("aprefill")
        self.generate_many([(sid, None)])

    async def aprefill(self, sid: int) -> None:
        await self._enqueue(self._submit(sid, None))

    async def agenerate(self, sid: int, params: SamplingParams | None = None, **kw) -> Generation:
        return await self._enqueue(self._submit(sid, params or SamplingParams(**kw)))

    async def _enqueue(self, req: _Request):
        req.future = asyncio.get_running_loop().create_future()
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run_loop())
        return await req.future

    async def _run_loop(self) -> None:
        try:
            while self._requests:
                self.step()
                await asyncio.sleep(0)  # let environments and other coroutines run between steps
        except BaseException as e:  # a fault of the loop itself (a request's own fails only it): fail every waiter
            for r in list(self._requests.values()):
                self._fail(r, e)
            raise

    def _sync_only(self, async_verb: str) -> None:
        if self._loop_task is not None and not self._loop_task.done():
            raise RuntimeError(f"the async loop is running: use {async_verb}")

    def _submit(self, sid: int, params: SamplingParams | None) -> _Request:
        st = self.table.get(sid)
        if self._generating(sid):
            raise RuntimeError(f"stream {sid} is already generating")
        if not st.ledger.num_pending:
            raise RuntimeError(f"stream {sid} has no pending token to continue from")
        if params is not None and params.forced_token_ids:
            self._token_ids(params.forced_token_ids, f"stream {sid} (forced tokens)")
        gen = None
        if params is not None and params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        req = _Request(sid, params, gen)
        self._requests[sid] = req
        return req

    def _idle(self, sid: int, verb: str) -> None:
        self.table.get(sid)
        if self._generating(sid):
            raise RuntimeError(f"cannot {verb} stream {sid} while it is generating")

    def _generating(self, sid: int) -> bool:
        """Whether ``sid`` has a request in flight. One whose waiter is gone (a cancelled
        ``agenerate``) is dropped here: between two steps nothing of it is in flight."""
        req = self._requests.get(sid)
        if req is not None and req.future is not None and req.future.cancelled():
            del self._requests[sid]
            return False
        return req is not None

    def _token_ids(self, ids, where: str) -> list[int]:
        """``ids`` as ints in ``[0, vocab_size)``, or a ``ValueError`` naming ``where`` and the first
        bad one: checked where tokens enter, since a step that met one would fail in the forward."""
        ids = list(ids)
        if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < self.vocab_size)):
            return ids
        out = []
        for i, t in enumerate(ids):
            try:
                if isinstance(t, bool):
                    raise TypeError
                tok = operator.index(t)
            except TypeError:
                raise ValueError(f"{where}: token {i} is {t!r}, not an integer token id") from None
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"{where}: token id {tok} (token {i}) is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
            out.append(tok)
        return out

    # ---- one scheduler step ----
    def step(self) -> None:
        """One forward over the scheduled requests. It either commits (slots, ledgers, outputs)
        or changes nothing: a request that cannot run fails before anything is allocated, and a
        forward that raises is undone and fails only the requests that raise alone."""
        for sid in list(self._requests):
            self._generating(sid)  # drops the requests whose waiter is gone
        mode, plan = self._schedule()
        if not plan:
            return
        try:
            self._attempt(mode, plan, keep=True)
        except Exception as error:
            self._isolate(mode, plan, error)

    def _schedule(self) -> tuple[Literal["extend", "decode"], list[_Planned]]:
        """The step's mode and requests, nano-vllm style: every request with several pending tokens
        (or a prefill) extends, up to ``max_prefill_tokens``; else every request decodes one token.
        A request whose tokens cannot fit fails here, before anything is allocated: over
        ``max_context``, or needing more slots than are free when it is the first to run (later
        ones wait for the next step)."""
        reqs = list(self._requests.values())
        extend = [r for r in reqs if self.table.get(r.sid).ledger.num_pending > 1 or r.params is None]
        mode = "extend" if extend else "decode"
        plan, budget, free = [], self.max_prefill_tokens, self.table.allocator.num_free
        for r in extend or reqs:
            st = self.table.get(r.sid)
            n = st.ledger.num_pending
            if len(st.slots) + n > self.slot_table.max_context:
                self._fail(r, ContextLengthError(
                    f"stream {r.sid} would hold {len(st.slots) + n} live tokens, more than max_context="
                    f"{self.slot_table.max_context}: evict (compact) or raise max_context"))
                continue
            if n > free:
                if plan:
                    break
                self._fail(r, OutOfSlotsError(f"stream {r.sid} needs {n} KV slots, {free} of "
                                              f"{self.table.allocator.num_slots} free: evict or close streams"))
                continue
            if mode == "extend" and plan and n > budget:
                break
            plan.append(_Planned(r, st, n))
            budget -= n
            free -= n
        return mode, plan

    def _attempt(self, mode, plan: list[_Planned], *, keep: bool) -> None:
        """One forward over ``plan``. ``keep``: sample and commit it. Otherwise, and whenever
        anything raises, undo it: the new slots are freed, the slot-table rows cut back and the
        INT8 side entries the step overwrote restored, so the pool, the tables and the ledgers are
        as before (the freed slots' bytes are not: no stream owns them)."""
        t0 = time.perf_counter()
        rows = [p.stream.row for p in plan]
        undo = _Undo(rows, [self.slot_table.lengths[row] for row in rows])
        try:
            for p in plan:
                undo.items.append(StepItem(p.stream, p.num_new, self.table.allocator.alloc(p.num_new)))
            items = undo.items
            self.slot_table.append_batch(rows, [it.num_new for it in items], [s for it in items for s in it.slots],
                                         [it.stream.ledger.num_computed for it in items])
            fb = self.backend.prepare(items, mode, self.slot_table, self.device)
            undo.saved = self.backend.save_overwritten(fb)
            logits = self.runner.forward(fb, self.backend)
            sampled = self._sample(plan, logits) if keep else {}
        except BaseException:
            self._undo(undo)
            raise
        if not keep:
            self._undo(undo)
            return
        for b, (it, p) in enumerate(zip(items, plan, strict=True)):
            it.stream.commit(it.slots)
            if b in sampled:
                self._record_sample(p.req, *sampled[b])
            else:
                self._finish(p.req, None)
        n_new = sum(it.num_new for it in items)
        if mode == "extend":
            self.stats.tokens_prefilled += n_new
        else:
            self.stats.tokens_decoded += n_new
        self.stats.tokens_in_streams += n_new
        self.stats.steps += 1
        self._update_slot_stats()
        if self.on_step is not None:
            self.on_step(StepInfo(mode, len(items), n_new, time.perf_counter() - t0, self.stats.live_slots,
                                  max(len(it.stream.slots) for it in items)))

    def _sample(self, plan: list[_Planned], logits: torch.Tensor) -> dict[int, tuple[int, float]]:
        """Token and logprob of every request of ``plan`` that samples (by its index in ``plan``)."""
        rows = [b for b, p in enumerate(plan) if p.req.params is not None]
        if not rows:
            return {}
        reqs = [plan[b].req for b in rows]
        tokens, logprobs = sample_batch(logits[rows], [r.params for r in reqs], [r.generator for r in reqs],
                                        [r.forced_token for r in reqs])
        return dict(zip(rows, zip(tokens, logprobs, strict=True), strict=True))

    def _undo(self, undo: _Undo) -> None:
        if undo.saved is not None:
            self.backend.restore_overwritten(undo.saved)
        for row, length in zip(undo.rows, undo.lengths, strict=True):
            self.slot_table.truncate(row, length)
        for it in undo.items:
            self.table.allocator.free(it.slots)

    def _isolate(self, mode, plan: list[_Planned], error: Exception) -> None:
        """The step's forward raised (and was undone). Each request is tried alone, undone
        again; those that raise fail, and the rest are scheduled by the next step exactly as if
        the failed ones had never been there. If none raises alone (the batch as a whole failed,
        e.g. out of memory), each runs alone, for real."""
        if len(plan) == 1:
            self._fail(plan[0].req, error)
            return
        failed = False
        for p in plan:
            try:
                self._attempt(mode, [p], keep=False)
            except Exception as e:
                self._fail(p.req, e)
                failed = True
        if failed:
            return
        for p in plan:
            try:
                self._attempt(mode, [p], keep=True)
            except Exception as e:
                self._fail(p.req, e)

    def _record_sample(self, req: _Request, tok: int, lp: float) -> None:
        self.table.get(req.sid).ledger.add_sampled(tok, lp, self.policy_version)
        req.out.token_ids.append(tok)
        req.out.logprobs.append(lp)
        if tok in req.params.stop_token_ids:
            req.out.finish_reason, req.done = "stop", True
        elif len(req.out.token_ids) >= req.params.max_new_tokens:
            req.out.finish_reason, req.done = "length", True
        if req.done:
            self._finish(req, req.out)

    def _finish(self, req: _Request, result) -> None:
        req.done = True
        del self._requests[req.sid]
        if req.future is not None and not req.future.done():
            req.future.set_result(result)

    def _fail(self, req: _Request, error: BaseException) -> None:
        """``req`` ends with ``error``; its stream keeps what earlier steps sampled."""
        req.done, req.error = True, error
        if self._requests.get(req.sid) is req:
            del self._requests[req.sid]
        if req.future is not None and not req.future.done():
            if isinstance(error, asyncio.CancelledError):
                req.future.cancel()
            else:
                req.future.set_exception(error)

    def _update_slot_stats(self) -> None:
        self.stats.live_slots = self.table.allocator.num_used
        self.stats.peak_slots = max(self.stats.peak_slots, self.stats.live_slots)

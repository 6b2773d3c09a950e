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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from trainer_masks import StreamLedger

from ..streams import FullPrecisionPool, KV4Pool, OutOfSlotsError, SlotTable, StreamTable
from .attention import FullPrecisionBackend, KV4Backend
from .batch import StepItem, build_replay_batch
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
    future: asyncio.Future | None = None


class Engine:
    """``model_path`` loads a checkpoint; ``model=`` runs an already-loaded Hugging Face model instead (several
    engines, e.g. with different pools, can share one). ``on_step`` is called after every scheduler step with
    its ``StepInfo``."""

    def __init__(self, model_path: str | None = None, *, model=None, kv_dtype: Literal["bf16", "kv4rl"] = "bf16",
                 device="cpu", dtype: torch.dtype | None = None, max_tokens: int = 65536, max_streams: int = 256,
                 sink: int = 16, recent: int = 128, max_prefill_tokens: int = 16384,
                 max_context: int | None = None, batch_invariant: bool = False,
                 on_step: Callable[[StepInfo], None] | None = None):
        if kv_dtype not in ("bf16", "kv4rl"):
            raise ValueError(f"kv_dtype must be 'bf16' or 'kv4rl', got {kv_dtype!r}")
        if batch_invariant and kv_dtype != "bf16":
            raise ValueError("batch_invariant needs kv_dtype='bf16': the trainer cannot replay INT4 rounding "
                             "bit for bit")
        self.device = torch.device(device)
        self.runner = ModelRunner(model_path, model=model, device=self.device, dtype=dtype,
                                  batch_invariant=batch_invariant)
        r = self.runner
        self.kv_dtype = kv_dtype
        if kv_dtype == "kv4rl":
            pool = KV4Pool(r.num_layers, max_tokens, max_streams, r.num_kv_heads, r.head_dim, sink=sink,
                           recent=recent, device=self.device)
            self.backend = KV4Backend(pool, num_q_heads=r.num_heads, max_streams=max_streams)
        else:
            pool = FullPrecisionPool(r.num_layers, max_tokens, r.num_kv_heads, r.head_dim, dtype=r.dtype,
                                     device=self.device)
            self.backend = FullPrecisionBackend(pool, invariant=batch_invariant, group=r.num_heads // r.num_kv_heads)
        self.pool = pool
        self.table = StreamTable(max_tokens, max_streams)
        self.slot_table = SlotTable(max_streams, max_context or min(max_tokens, 65536), self.device)
        self.max_prefill_tokens = max_prefill_tokens
        self.policy_version = 0
        self.stats = EngineStats()
        self._requests: dict[int, _Request] = {}
        self._loop_task: asyncio.Task | None = None
        self.on_step = on_step

    # ---- stream verbs ----
    def open_stream(self, stream: list[int] | StreamLedger) -> int:
        """A new stream on ``stream``'s tokens (pending: prefilled with the first generation). A
        ``StreamLedger`` is adopted as the stream's ledger, and stays the caller's view of it."""
        if not (stream.token_ids if isinstance(stream, StreamLedger) else stream):
            raise ValueError("open_stream needs at least one token")
        return self.table.open(stream).sid

    def append(self, sid: int, token_ids: list[int], *, source: Literal["env", "prompt"] = "env") -> None:
        self._idle(sid, "append to")
        self.table.get(sid).ledger.append(token_ids, source)

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
        groups: list[list] = []
        for st in (st for st in streams if st.ledger.num_computed > 0):
            computed = sum(g.ledger.num_computed for g in groups[-1]) if groups else 0
            if not groups or computed + st.ledger.num_computed > self.max_prefill_tokens:
                groups.append([])
            groups[-1].append(st)
        total = 0
        r = self.runner
        if impl == "auto" and r.batch_invariant:
            impl = "invariant"
        for group in groups:
            replay(r.model, self.pool, build_replay_batch(group, self.device, impl=impl, pool=self.pool,
                                                          group=r.num_heads // r.num_kv_heads))
            n = sum(st.ledger.num_computed for st in group)
            self.stats.tokens_reprefilled_on_update += n
            total += n
        return total

    # ---- generation ----
    def generate(self, sid: int, *, max_new_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, stop_token_ids=(), seed: int | None = None) -> Generation:
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, tuple(stop_token_ids), seed)
        return self.generate_many([(sid, params)])[0]

    def generate_many(self, requests: list[tuple[int, SamplingParams]]) -> list[Generation]:
        """Generate for several streams at once (continuous batching)."""
        if self._loop_task is not None and not self._loop_task.done():
            raise RuntimeError("the async loop is running: use agenerate")
        reqs = [self._submit(sid, params) for sid, params in requests]
        while not all(r.done for r in reqs):
            self.step()
        return [r.out for r in reqs]

    def prefill(self, sid: int) -> None:
        """Compute the KV of every pending token now, sampling nothing (e.g. so that a
        just-written exchange can be evicted before the next turn)."""
        if self._loop_task is not None and not self._loop_task.done():
            raise RuntimeError("the async loop is running: use aprefill")
        req = self._submit(sid, None)
        while not req.done:
            self.step()

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
        while self._requests:
            try:
                self.step()
            except Exception as e:  # fail every waiter rather than hang them
                for r in list(self._requests.values()):
                    if r.future is not None and not r.future.done():
                        r.future.set_exception(e)
                self._requests.clear()
                raise
            await asyncio.sleep(0)  # let environments and other coroutines run between steps

    def _submit(self, sid: int, params: SamplingParams) -> _Request:
        st = self.table.get(sid)
        if sid in self._requests:
            raise RuntimeError(f"stream {sid} is already generating")
        if not st.ledger.num_pending:
            raise RuntimeError(f"stream {sid} has no pending token to continue from")
        gen = None
        if params is not None and params.seed is not None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(params.seed)
        req = _Request(sid, params, gen)
        self._requests[sid] = req
        return req

    def _idle(self, sid: int, verb: str) -> None:
        self.table.get(sid)
        if sid in self._requests:
            raise RuntimeError(f"cannot {verb} stream {sid} while it is generating")

    # ---- one scheduler step ----
    def step(self) -> None:
        reqs = list(self._requests.values())
        if not reqs:
            return
        t0 = time.perf_counter()
        extend = [r for r in reqs if self.table.get(r.sid).ledger.num_pending > 1 or r.params is None]
        mode = "extend" if extend else "decode"
        chosen = extend if extend else reqs
        items, budget = [], self.max_prefill_tokens
        for r in chosen:
            st = self.table.get(r.sid)
            n = st.ledger.num_pending
            if mode == "extend" and items and n > budget:
                break
            try:
                slots = self.table.allocator.alloc(n)
            except OutOfSlotsError:
                if items:
                    break
                raise
            items.append(StepItem(st, n, slots))
            budget -= n
        self.slot_table.append_batch([it.stream.row for it in items], [it.num_new for it in items],
                                     [s for it in items for s in it.slots],
                                     [it.stream.ledger.num_computed for it in items])
        fb = self.backend.prepare(items, mode, self.slot_table, self.device)
        logits = self.runner.forward(fb, self.backend)
        reqs = [self._requests[it.stream.sid] for it in items]
        rows = [b for b, r in enumerate(reqs) if r.params is not None]
        tokens, logprobs = (sample_batch(logits[rows], [reqs[b].params for b in rows],
                                         [reqs[b].generator for b in rows]) if rows else ([], []))
        sampled = dict(zip(rows, zip(tokens, logprobs, strict=True), strict=True))
        for b, (it, req) in enumerate(zip(items, reqs, strict=True)):
            it.stream.commit(it.slots)
            if b in sampled:
                self._record_sample(req, *sampled[b])
            else:
                self._finish(req, None)
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

    def _update_slot_stats(self) -> None:
        self.stats.live_slots = self.table.allocator.num_used
        self.stats.peak_slots = max(self.stats.peak_slots, self.stats.live_slots)

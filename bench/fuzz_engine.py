"""Random fuzz of the built-in engine's sync and async APIs, with injected faults.

Ops: open, append, generate (``generate_many``, one to three streams, random sampling, some
teacher-forced), prefill, evict, close, reprefill, and bursts of concurrent episodes on the async
API (``agenerate``, ``aprefill``, append, evict, a cancelled waiter). Faults injected on purpose:

- ``bad id``: a token id outside the vocabulary, negative, a string, a float or a bool, to
  ``open_stream``, ``append`` or as a forced token: refused, nothing changes;
- ``forward exception``: a stream position is armed (``ForwardFaults``) and every forward that
  computes it raises after all layers wrote their KV; the request computing it must get
  ``InjectedFault`` with its stream as before that step, the others run on;
- ``pool exhaustion`` / ``over-long context``: a stream is given more pending tokens than there
  are free slots / than ``max_context`` allows, then generated alone: ``OutOfSlotsError`` /
  ``ContextLengthError``, nothing allocated (both also arise on their own in batches: counted as
  seen unprovoked);
- ``invalid eviction``: floats, pending or already evicted positions, overlaps: refused;
- ``cancelled waiter``: an ``agenerate`` cancelled mid-generation: its request is dropped.

After every op: the slot allocator's free + owned slots == capacity with every owned slot owned
once (``StreamTable.check``), each stream's slot-table row equals its slots and positions, no
request is left in the engine without a live waiter (none at all between sync calls); at the end
every stream closes and the whole pool is free. A violation stops the run and is reported.

``python -m bench.fuzz_engine --ops 100000 --seed 3`` (both KV storages, a 1-layer random
model on the CPU); ``tests/test_engine_fuzz.py`` runs a few hundred ops of it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from kvstreams_sglang.engine import Engine, Generation, SamplingParams
from kvstreams_sglang.streams import ContextLengthError, EvictionError, OutOfSlotsError

FAULT_KINDS = ("bad id", "forward exception", "pool exhaustion", "over-long context", "invalid eviction",
               "cancelled waiter")


class InjectedFault(RuntimeError):
    """The forward exception ``ForwardFaults`` raises."""


class ForwardFaults:
    """Makes ``engine``'s forward raise in every step that computes an armed position of a stream
    (a poisoned input: the step raises each time it is tried, batched or alone). It raises at the
    last layer, after every layer wrote the step's KV (and KV4 side copies), so that undoing the
    step is really exercised."""

    def __init__(self, engine: Engine):
        self.engine, self.armed = engine, {}
        self.raised = 0  # forward passes that raised (a batched step and its solo retries)
        backend = engine.backend
        self._prepare, self._forward = backend.prepare, backend.forward
        backend.prepare, backend.forward = self._prepare_step, self._forward_layer
        self._last_layer = engine.runner.num_layers - 1
        self._hit = False

    def arm(self, sid: int, position: int) -> None:
        self.armed.setdefault(sid, set()).add(position)

    def disarm(self, sid: int) -> None:
        self.armed.pop(sid, None)

    def _prepare_step(self, items, mode, table, device):
        self._hit = any(p in self.armed.get(it.stream.sid, ())
                        for it in items for p in range(it.stream.ledger.num_computed,
                                                       it.stream.ledger.num_computed + it.num_new))
        return self._prepare(items, mode, table, device)

    def _forward_layer(self, layer, q, k, v, fb, scaling):
        out = self._forward(layer, q, k, v, fb, scaling)
        if self._hit and layer == self._last_layer:
            self.raised += 1
            raise InjectedFault("injected forward fault")
        return out


class InvariantViolation(AssertionError):
    pass


def check_invariants(eng: Engine, *, sync: bool) -> None:
    """The engine's books balance: slots, slot-table rows, requests and their waiters."""
    eng.table.check()  # every used slot is owned by exactly one live token of one stream
    alloc = eng.table.allocator
    owned = sum(len(st.slots) for st in eng.table.streams.values())
    if alloc.num_free + owned != alloc.num_slots:
        raise InvariantViolation(f"free {alloc.num_free} + owned {owned} != capacity {alloc.num_slots}")
    rows = [st.row for st in eng.table.streams.values()]
    if len(set(rows)) != len(rows):
        raise InvariantViolation(f"two streams share a row: {rows}")
    for st in eng.table.streams.values():
        n = eng.slot_table.lengths[st.row]
        if (n != len(st.slots) or eng.slot_table.slots[st.row, :n].tolist() != st.slots
                or eng.slot_table.positions[st.row, :n].tolist() != st.positions):
            raise InvariantViolation(f"stream {st.sid}: slot-table row {st.row} differs from its slots/positions")
    if sync and eng._requests:
        raise InvariantViolation(f"requests left behind by a sync call: streams {sorted(eng._requests)}")
    for sid, r in eng._requests.items():
        if sid not in eng.table.streams:
            raise InvariantViolation(f"a request for closed stream {sid}")
        if r.future is None or (r.future.done() and not r.future.cancelled()):
            raise InvariantViolation(f"stream {sid}: a request without a waiter")
    if eng._requests and (eng._loop_task is None or eng._loop_task.done()):
        raise InvariantViolation(f"requests {sorted(eng._requests)} but no loop to run them")


@dataclass
class FaultCount:
    injected: int = 0
    handled: int = 0


@dataclass
class FuzzReport:
    kv_dtype: str
    ops: Counter = field(default_factory=Counter)
    faults: dict[str, FaultCount] = field(default_factory=lambda: {k: FaultCount() for k in FAULT_KINDS})
    unprovoked: Counter = field(default_factory=Counter)  # faults that arose on their own (and were handled)
    violations: list[str] = field(default_factory=list)
    steps: int = 0
    seconds: float = 0.0

    @property
    def ops_tried(self) -> int:
        return sum(self.ops.values())

    def table(self) -> str:
        lines = [f"kv_dtype={self.kv_dtype}: {self.ops_tried} ops in {self.seconds:.1f} s ({self.steps} engine steps), "
                 f"invariant violations: {len(self.violations)}",
                 "  ops tried: " + ", ".join(f"{k} {v}" for k, v in sorted(self.ops.items())),
                 f"  {'fault':<20}{'injected':>10}{'handled':>10}{'unprovoked':>12}"]
        for kind, c in self.faults.items():
            lines.append(f"  {kind:<20}{c.injected:>10}{c.handled:>10}{self.unprovoked[kind]:>12}")
        total = FaultCount(sum(c.injected for c in self.faults.values()), sum(c.handled for c in self.faults.values()))
        lines.append(f"  {'total':<20}{total.injected:>10}{total.handled:>10}{sum(self.unprovoked.values()):>12}")
        lines.extend(f"  VIOLATION: {v}" for v in self.violations)
        return "\n".join(lines)


def fuzz_engine(model_path: str, *, ops: int, seed: int, kv_dtype: str = "bf16", max_tokens: int = 100,
                max_streams: int = 6, max_context: int = 64) -> FuzzReport:
    """``ops`` random operations on a fresh engine; stops at the first invariant violation."""
    eng = Engine(model_path, kv_dtype=kv_dtype, kv_slots=max_tokens, max_streams=max_streams,
                 max_context=max_context, sink=4, recent=8, max_prefill_tokens=128)
    fuzzer = _Fuzzer(eng, random.Random(seed), FuzzReport(kv_dtype))
    t0 = time.perf_counter()
    try:
        while fuzzer.report.ops_tried < ops:
            fuzzer.one_op(ops - fuzzer.report.ops_tried)
        for sid in list(eng.table.streams):  # every open stream can still be closed
            eng.close(sid)
        if eng.table.allocator.num_free != max_tokens:
            raise InvariantViolation(f"all streams closed but {eng.table.allocator.num_free} of {max_tokens} free")
    except AssertionError as e:  # InvariantViolation, or StreamTable.check's
        fuzzer.report.violations.append(f"after op {fuzzer.report.ops_tried} (seed {seed}): {e}")
    fuzzer.report.seconds = time.perf_counter() - t0
    fuzzer.report.steps = eng.stats.steps
    return fuzzer.report


def _state(eng: Engine, sid: int) -> tuple:
    """What a refused or failed call on ``sid`` must leave as it was: its ledger and its slots."""
    st = eng.table.get(sid)
    return st.ledger.to_record(), list(st.slots)


class _Fuzzer:
    def __init__(self, eng: Engine, rng: random.Random, report: FuzzReport):
        self.eng, self.rng, self.report = eng, rng, report
        self.faults = ForwardFaults(eng)
        self.vocab = eng.vocab_size

    # ---- helpers ----
    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def bad_tokens(self) -> list:
        good = self.tokens(self.rng.randint(0, 3))
        bad = self.rng.choice([self.vocab, self.vocab + 12345, -1, "7", 3.0, True, None])
        good.insert(self.rng.randint(0, len(good)), bad)
        return good

    def idle(self, need_pending: bool = False) -> list[int]:
        return [sid for sid, st in self.eng.table.streams.items()
                if sid not in self.eng._requests and (st.ledger.num_pending or not need_pending)]

    def room(self, sid: int, n: int) -> bool:
        """Whether ``n`` more tokens (and a few sampled ones) fit in the stream's ``max_context``."""
        st = self.eng.table.get(sid)
        return len(st.slots) + st.ledger.num_pending + n + 4 <= self.eng.slot_table.max_context

    def fits(self, sid: int) -> bool:
        """Whether the stream's pending tokens fit (in the free slots and in ``max_context``)."""
        st = self.eng.table.get(sid)
        n = st.ledger.num_pending
        return n <= self.eng.table.allocator.num_free and len(st.slots) + n <= self.eng.slot_table.max_context

    def params(self, forced: bool = False) -> SamplingParams:
        r = self.rng
        n = r.randint(1, 4)
        if forced:
            return SamplingParams(forced_token_ids=tuple(self.tokens(n)), temperature=r.choice([0.0, 1.0]))
        return SamplingParams(max_new_tokens=n, temperature=r.choice([0.0, 0.7, 1.0]), top_k=r.choice([0, 0, 5]),
                              top_p=r.choice([1.0, 1.0, 0.9]), seed=r.choice([None, r.randrange(1000)]),
                              stop_token_ids=tuple(self.tokens(r.choice([0, 0, 1]))))

    def arm(self, sid: int, params: SamplingParams) -> tuple[int, SamplingParams]:
        """Arm a position the request will compute: one of its pending tokens (the first step) or
        a token it will sample (a later decode step); no stop tokens, so that it gets there."""
        led = self.eng.ledger(sid)
        if self.rng.random() < 0.5 or params.max_new_tokens < 2:
            pos = self.rng.randrange(led.num_computed, led.end)
        else:
            pos = led.end + self.rng.randrange(params.max_new_tokens - 1)
        self.faults.arm(sid, pos)
        return pos, SamplingParams(max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                                   seed=params.seed, forced_token_ids=params.forced_token_ids)

    def expect(self, kind: str, ok: bool, what: str) -> None:
        self.report.faults[kind].injected += 1
        if not ok:
            raise InvariantViolation(f"{kind} not handled: {what}")
        self.report.faults[kind].handled += 1

    def outcome(self, sid: int, result, armed: int | None, before) -> None:
        """Check one request's result; ``armed``: the position armed on it (``before``: its state then)."""
        led = self.eng.ledger(sid)
        if armed is not None:
            self.faults.disarm(sid)
            if isinstance(result, InjectedFault):
                # the failed step changed nothing: the stream holds what the earlier steps computed
                record, slots = _state(self.eng, sid)
                if armed < len(before[0]):  # a pending token: the request's first step failed
                    ok = (record, slots) == before
                else:  # a sampled one: the steps up to sampling it ran
                    ok = (led.num_computed == armed and led.end == armed + 1 and slots[:len(before[1])] == before[1]
                          and record.token_ids[:len(before[0])] == before[0].token_ids)
                self.expect("forward exception", ok, f"stream {sid} armed at {armed}, computed {led.num_computed}")
                return
            if led.num_computed > armed:
                raise InvariantViolation(f"stream {sid}: armed position {armed} was computed without a fault")
        if isinstance(result, Generation):
            return
        if isinstance(result, OutOfSlotsError):
            self.report.unprovoked["pool exhaustion"] += 1
        elif isinstance(result, ContextLengthError):
            self.report.unprovoked["over-long context"] += 1
        else:
            raise InvariantViolation(f"stream {sid}: unexpected {type(result).__name__}: {result}")

    # ---- ops ----
    def one_op(self, budget: int) -> None:
        """One op drawn by its share of the mix (cumulative thresholds over a uniform draw); an engine with no
        stream always opens one."""
        mix = ((0.12, self.op_open), (0.28, self.op_append), (0.55, self.op_generate), (0.60, self.op_overflow),
               (0.65, self.op_prefill), (0.80, self.op_evict), (0.88, self.op_close), (0.89, self.op_reprefill),
               (1.0, lambda: asyncio.run(self.burst(min(budget, self.rng.randint(3, 12))))))
        r = self.rng.random()
        op = self.op_open if not self.eng.table.streams else next(fn for edge, fn in mix if r < edge)
        op()
        check_invariants(self.eng, sync=True)

    def op_reprefill(self) -> None:
        self.report.ops["reprefill"] += 1
        self.eng.reprefill()

    def op_open(self) -> None:
        eng, rep = self.eng, self.report
        if len(eng.table.streams) >= eng.table.max_streams:
            self.op_close()
            return
        rep.ops["open"] += 1
        if self.rng.random() < 0.15:
            before = dict(eng.table.streams)
            try:
                eng.open_stream(self.bad_tokens())
                ok = False
            except ValueError:
                ok = dict(eng.table.streams) == before
            self.expect("bad id", ok, "open_stream")
            return
        eng.open_stream(self.tokens(self.rng.randint(1, 24)))

    def op_append(self) -> None:
        self.report.ops["append"] += 1
        idle = self.idle()
        if not idle:
            return
        sid = self.rng.choice(idle)
        if not self.room(sid, 16):  # as an agent compacts its context before it grows too long
            self.evict(sid, valid=True)
            return
        if self.rng.random() < 0.15:
            before = _state(self.eng, sid)
            try:
                self.eng.append(sid, self.bad_tokens())
                ok = False
            except ValueError:
                ok = _state(self.eng, sid) == before
            self.expect("bad id", ok, f"append to stream {sid}")
            return
        self.eng.append(sid, self.tokens(self.rng.randint(1, 16)))

    def op_generate(self) -> None:
        self.report.ops["generate"] += 1
        idle = self.idle(need_pending=True)
        if not idle:
            return
        sids = self.rng.sample(idle, min(len(idle), self.rng.randint(1, 3)))
        params = [self.params(forced=self.rng.random() < 0.2) for _ in sids]
        armed, before = {}, {}
        if self.rng.random() < 0.2:
            i = self.rng.randrange(len(sids))
            before[sids[i]] = _state(self.eng, sids[i])
            armed[sids[i]], params[i] = self.arm(sids[i], params[i])
        if self.rng.random() < 0.05:  # a bad forced token: the whole call is refused before any step
            params[-1] = SamplingParams(forced_token_ids=(self.rng.choice([self.vocab, -3]),))
            before = [_state(self.eng, sid) for sid in sids]
            try:
                self.eng.generate_many(list(zip(sids, params, strict=True)))
                ok = False
            except ValueError:
                ok = not self.eng._requests and [_state(self.eng, sid) for sid in sids] == before
            self.expect("bad id", ok, "forced token")
            for sid in armed:
                self.faults.disarm(sid)
            return
        results = self.eng.generate_many(list(zip(sids, params, strict=True)), return_exceptions=True)
        for sid, res in zip(sids, results, strict=True):
            self.outcome(sid, res, armed.get(sid), before.get(sid))

    def op_overflow(self) -> None:
        """One stream given more pending tokens than fit (slots or max_context), generated alone."""
        eng, rep = self.eng, self.report
        rep.ops["generate"] += 1
        idle = self.idle()
        if not idle:
            return
        sid = self.rng.choice(idle)
        st = eng.table.get(sid)
        room = eng.slot_table.max_context - len(st.slots) - st.ledger.num_pending  # more and it cannot fit
        free = eng.table.allocator.num_free
        kind = "pool exhaustion" if free - st.ledger.num_pending < room else "over-long context"
        extra = (free - st.ledger.num_pending + 1) if kind == "pool exhaustion" else room + 1
        if extra < 1:
            return
        eng.append(sid, self.tokens(extra))
        before = _state(eng, sid), free
        (res,) = eng.generate_many([(sid, self.params())], return_exceptions=True)
        want = OutOfSlotsError if kind == "pool exhaustion" else ContextLengthError
        ok = isinstance(res, want) and (_state(eng, sid), eng.table.allocator.num_free) == before
        self.expect(kind, ok, f"stream {sid}: {res!r}")

    def op_prefill(self) -> None:
        self.report.ops["prefill"] += 1
        idle = self.idle(need_pending=True)
        if not idle:
            return
        sid = self.rng.choice(idle)
        led = self.eng.ledger(sid)
        if self.rng.random() < 0.3 and self.fits(sid):
            before = _state(self.eng, sid), self.eng.table.allocator.num_free
            self.faults.arm(sid, self.rng.randrange(led.num_computed, led.end))
            try:
                self.eng.prefill(sid)
                ok = False
            except InjectedFault:
                ok = (_state(self.eng, sid), self.eng.table.allocator.num_free) == before
            self.faults.disarm(sid)
            self.expect("forward exception", ok, f"prefill of stream {sid}")
            return
        try:
            self.eng.prefill(sid)
        except (OutOfSlotsError, ContextLengthError) as e:
            self.report.unprovoked["pool exhaustion" if isinstance(e, OutOfSlotsError) else "over-long context"] += 1

    def op_evict(self) -> None:
        self.report.ops["evict"] += 1
        idle = [sid for sid in self.idle() if self.eng.table.get(sid).positions]
        if not idle:
            return
        self.evict(self.rng.choice(idle))

    def evict(self, sid: int, valid: bool = False) -> None:
        st, rng = self.eng.table.get(sid), self.rng
        if not st.positions:
            return
        if not valid and rng.random() < 0.3:
            led = st.ledger
            spans = rng.choice([[(0.5, 1.5)], [(0, 1.0)], [(led.num_computed - 1, led.end + 1)],
                                [(0, 2), (1, 3)], [(3, 3)], [("a", "b")]])
            evicted = [p for p in range(led.num_computed) if not led.is_live(p)]
            if evicted:
                spans = rng.choice([spans, [(evicted[0], evicted[0] + 1)]])
            before = _state(self.eng, sid), self.eng.table.allocator.num_free
            try:
                self.eng.evict(sid, spans)
                ok = False
            except EvictionError:
                ok = (_state(self.eng, sid), self.eng.table.allocator.num_free) == before
            self.expect("invalid eviction", ok, f"stream {sid}, spans {spans}")
            return
        i = rng.randrange(len(st.positions))
        j = i
        while j + 1 < len(st.positions) and st.positions[j + 1] == st.positions[j] + 1 and j - i < 15:
            j += 1
        self.eng.evict(sid, [(st.positions[i], st.positions[j] + 1)])

    def op_close(self) -> None:
        self.report.ops["close"] += 1
        idle = self.idle()
        if idle:
            self.eng.close(self.rng.choice(idle))

    # ---- async ----
    async def burst(self, n_ops: int) -> None:
        """Concurrent episodes on the async API, ``n_ops`` ops in all, invariants after each."""
        idle = self.idle()
        while len(idle) < 2 and len(self.eng.table.streams) < self.eng.table.max_streams:
            idle.append(self.eng.open_stream(self.tokens(self.rng.randint(1, 24))))
        sids = self.rng.sample(idle, min(len(idle), self.rng.randint(2, 4)))
        share = [n_ops // len(sids) + (i < n_ops % len(sids)) for i in range(len(sids))]
        await asyncio.gather(*(self.episode(sid, n) for sid, n in zip(sids, share, strict=True)))
        while self.eng._requests:  # dropped cancelled requests: the loop ends once they are gone
            await asyncio.sleep(0)
        check_invariants(self.eng, sync=True)

    async def episode(self, sid: int, n_ops: int) -> None:
        eng, rng, rep = self.eng, self.rng, self.report
        for _ in range(n_ops):
            if sid not in eng.table.streams:
                return
            r = rng.random()
            if r < 0.45 and eng.ledger(sid).num_pending:
                rep.ops["agenerate"] += 1
                params, armed, before = self.params(forced=rng.random() < 0.2), None, None
                if rng.random() < 0.2:
                    before = _state(eng, sid)
                    armed, params = self.arm(sid, params)
                try:
                    res = await eng.agenerate(sid, params)
                except Exception as e:
                    res = e
                self.outcome(sid, res, armed, before)
            elif r < 0.55 and eng.ledger(sid).num_pending:
                rep.ops["aprefill"] += 1
                try:
                    await eng.aprefill(sid)
                except (OutOfSlotsError, ContextLengthError) as e:
                    rep.unprovoked["pool exhaustion" if isinstance(e, OutOfSlotsError) else "over-long context"] += 1
            elif r < 0.65 and eng.ledger(sid).num_pending:
                rep.ops["agenerate"] += 1
                task = asyncio.ensure_future(eng.agenerate(sid, SamplingParams(max_new_tokens=8)))
                for _ in range(rng.randint(1, 4)):
                    await asyncio.sleep(0)
                cancelled = sid in eng._requests and task.cancel()
                try:
                    self.outcome(sid, await task, None, None)
                except asyncio.CancelledError:
                    pass
                except Exception as e:  # it may have failed before the cancel (pool, context)
                    self.outcome(sid, e, None, None)
                for _ in range(100):  # the next step drops the request of the cancelled waiter
                    if sid not in eng._requests:
                        break
                    await asyncio.sleep(0)
                if cancelled:
                    self.expect("cancelled waiter", sid not in eng._requests, f"stream {sid} still generating")
            elif r < 0.8:
                rep.ops["append"] += 1
                if self.room(sid, 8):
                    eng.append(sid, self.tokens(rng.randint(1, 8)))
                else:
                    self.evict(sid, valid=True)
            elif r < 0.95:
                rep.ops["evict"] += 1
                self.evict(sid)
            else:
                rep.ops["close"] += 1
                eng.close(sid)
            check_invariants(eng, sync=False)
            await asyncio.sleep(0)


def build_fuzz_model(path) -> str:
    """A 1-layer random Qwen3 (hidden 32, head_dim 32): the fuzz exercises bookkeeping, not numerics."""
    from kvstreams_sglang.checkpoints import build_tiny_model

    return str(build_tiny_model(path, num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, head_dim=32))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ops", type=int, default=10000, help="ops per KV storage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-dtype", nargs="+", default=["bf16", "kv4rl"], choices=["bf16", "kv4rl"])
    ap.add_argument("--model", help="a checkpoint (default: a 1-layer random model built in a temp dir)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny matmuls: more only spin)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = a.model or build_fuzz_model(tmp)
        reports = [fuzz_engine(model, ops=a.ops, seed=a.seed, kv_dtype=kv) for kv in a.kv_dtype]
    for rep in reports:
        print(rep.table())
    return 1 if any(rep.violations for rep in reports) else 0


if __name__ == "__main__":
    raise SystemExit(main())

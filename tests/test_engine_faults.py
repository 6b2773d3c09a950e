"""Faults stay with the request that caused them (issue 25): a failed step changes nothing, the
request that failed gets the exception, the others run on exactly as they would have without it,
and no request, slot or stream is left stuck."""

import asyncio

import numpy as np
import pytest
import torch

from bench.fuzz_engine import ForwardFaults, InjectedFault
from kvstreams_sglang.engine import Engine, SamplingParams
from kvstreams_sglang.kv4.regions import protected_mask, side_slots_of
from kvstreams_sglang.streams import ContextLengthError, EvictionError, OutOfSlotsError
from trainer_masks import StreamLedger

CAPACITY = 512


def make(path, kv_dtype="bf16", **kw):
    kw = dict(kv_slots=CAPACITY, max_streams=4, dtype=torch.float32) | kw
    return Engine(str(path), kv_dtype=kv_dtype, sink=4, recent=8, **kw)  # a small ring: decodes overwrite it


def stream_kv(eng, sid) -> list[list]:
    """The stream's KV as stored, per layer, its kept tokens in position order (KV4: INT4 entries
    and the INT8 side copies of its protected positions)."""
    st = eng.table.get(sid)
    slots = torch.tensor(st.slots, dtype=torch.long)
    if eng.kv_dtype == "bf16":
        return [t[slots].tolist() for t in eng.pool.k + eng.pool.v]
    pos = torch.tensor(st.positions, dtype=torch.long)
    sink, recent = eng.pool.sink, eng.pool.recent
    side = side_slots_of(torch.tensor(st.row), pos[protected_mask(pos, st.ledger.num_computed, sink=sink,
                                                                  recent=recent)], sink=sink, recent=recent)
    return [t.tolist() for c in eng.pool.layers for t in (c.k_codes[slots], c.k_meta[slots], c.v_codes[slots],
                                                          c.v_meta[slots], c.k_side[side], c.k_side_scale[side],
                                                          c.v_side[side], c.v_side_scale[side])]


def streams_kv(eng) -> dict:
    """Each stream's ledger and KV (what two engines that ran the same requests agree on; which
    slot holds what may differ)."""
    return {sid: (s.ledger.to_record(), stream_kv(eng, sid)) for sid, s in eng.table.streams.items()}


def engine_state(eng) -> dict:
    """Everything a failed step must leave as it was: ledgers, slots, slot-table rows, the KV of
    every stream and (KV4) the whole INT8 side cache; the allocator's free list."""
    st = eng.slot_table
    rows = {sid: (list(s.slots), st.slots[s.row, :st.lengths[s.row]].tolist(),
                  st.positions[s.row, :st.lengths[s.row]].tolist()) for sid, s in eng.table.streams.items()}
    return dict(streams=streams_kv(eng), rows=rows, free=sorted(eng.table.allocator._free), lengths=list(st.lengths),
                requests=dict(eng._requests),
                side=[t.tolist() for t in eng.pool.side.values()] if eng.kv_dtype == "kv4rl" else None)


@pytest.mark.parametrize("kv_dtype", ["bf16", "kv4rl"])
def test_a_failed_step_changes_nothing(tiny_model_path, kv_dtype):
    eng = make(tiny_model_path, kv_dtype)
    faults = ForwardFaults(eng)
    a, b = eng.open_stream(list(range(30, 60))), eng.open_stream(list(range(40, 52)))
    eng.generate_many([(a, SamplingParams(max_new_tokens=6, seed=0)), (b, SamplingParams(max_new_tokens=6, seed=1))])
    eng.evict(a, [(10, 14)])
    eng.append(b, [70, 71, 72])  # b's new tokens take ring slots that hold its live positions 9..12
    faults.arm(b, eng.ledger(b).num_computed + 1)
    before = engine_state(eng)
    with pytest.raises(InjectedFault):
        eng.prefill(b)
    assert engine_state(eng) == before
    with pytest.raises(InjectedFault):
        asyncio.run(eng.aprefill(b))
    with pytest.raises(InjectedFault):
        eng.generate(b, max_new_tokens=3, seed=2)
    assert engine_state(eng) == before and faults.raised == 3
    faults.disarm(b)  # the stream is usable again, and computes what an unfaulted engine does
    eng.generate(b, max_new_tokens=3, seed=2)
    ref = make(tiny_model_path, kv_dtype)
    ra, rb = ref.open_stream(list(range(30, 60))), ref.open_stream(list(range(40, 52)))
    ref.generate_many([(ra, SamplingParams(max_new_tokens=6, seed=0)), (rb, SamplingParams(max_new_tokens=6, seed=1))])
    ref.evict(ra, [(10, 14)])
    ref.append(rb, [70, 71, 72])
    ref.generate(rb, max_new_tokens=3, seed=2)
    assert streams_kv(eng) == streams_kv(ref)


DECODE_FAULT = 2  # bad's forward raises when it computes the 3rd token it sampled


def three_streams(path, kv_dtype, *, fault, api, reference):
    """g1, g2 and bad: a round of prefill and decode, an observation each, then a second round
    in which bad's forward raises (``fault="extend"``: on its observation, the round's first step;
    ``"decode"``: on a token it sampled). The ``reference`` runs the same without the fault, and
    without bad from the step where the fault stops it (no second round for bad, or a shorter one)."""
    eng = make(path, kv_dtype)
    faults = ForwardFaults(eng)
    sids = [eng.open_stream(list(range(s, s + n))) for s, n in ((30, 25), (50, 14), (80, 19))]
    eng.generate_many([(s, SamplingParams(max_new_tokens=5, seed=i)) for i, s in enumerate(sids)])
    for s in sids:
        eng.append(s, [100 + s, 101, 102])
    g1, g2, bad = sids
    second = [(g1, SamplingParams(max_new_tokens=7, seed=10)), (g2, SamplingParams(max_new_tokens=7, seed=11))]
    led = eng.ledger(bad)
    if fault == "extend" and not reference:
        faults.arm(bad, led.num_computed + 2)
        second.append((bad, SamplingParams(max_new_tokens=6, seed=12)))
    if fault == "decode":
        if not reference:
            faults.arm(bad, led.end + DECODE_FAULT)
        second.append((bad, SamplingParams(max_new_tokens=DECODE_FAULT + 1 if reference else 6, seed=12)))
    if api == "sync":
        outs = eng.generate_many(second, return_exceptions=True)
    else:
        async def main():
            return await asyncio.gather(*(eng.agenerate(s, p) for s, p in second), return_exceptions=True)

        outs = asyncio.run(main())
    return eng, sids, outs


@pytest.mark.parametrize("fault", ["extend", "decode"])
@pytest.mark.parametrize("api", ["sync", "async"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "kv4rl"])
def test_a_forward_fault_fails_only_its_request(tiny_model_path, kv_dtype, api, fault):
    eng, sids, outs = three_streams(tiny_model_path, kv_dtype, fault=fault, api=api, reference=False)
    ref, ref_sids, ref_outs = three_streams(tiny_model_path, kv_dtype, fault=fault, api=api, reference=True)
    assert isinstance(outs[2], InjectedFault) and not eng._requests
    for out, want in zip(outs[:2], ref_outs[:2], strict=True):  # bit for bit: same steps, same batches
        assert (out.token_ids, out.logprobs) == (want.token_ids, want.logprobs)
    assert streams_kv(eng) == streams_kv(ref)  # bad's too: as before the failed step
    assert eng.table.allocator.num_free == ref.table.allocator.num_free
    for sid in sids:
        eng.close(sid)
    assert eng.table.allocator.num_free == CAPACITY


def test_out_of_slots_fails_the_requests_and_leaves_their_streams_usable(tiny_model_path):
    """Issue 25 E1: the requests used to stay behind, so their streams could not be closed, evicted
    or appended to, and the next generate ran them."""
    eng = Engine(str(tiny_model_path), kv_slots=24, max_streams=4)
    a, b = eng.open_stream(list(range(10))), eng.open_stream(list(range(10, 20)))
    with pytest.raises(OutOfSlotsError):
        eng.generate_many([(a, SamplingParams(max_new_tokens=10, seed=0)), (b, SamplingParams(max_new_tokens=10,
                                                                                              seed=1))])
    assert not eng._requests
    # 24 slots: the prompts, then two decode steps; each stream keeps its 3 sampled tokens, the last pending
    assert [(eng.ledger(s).num_computed, eng.ledger(s).end) for s in (a, b)] == [(12, 13), (12, 13)]
    eng.evict(a, [(0, 6)])
    eng.append(a, [5])
    assert len(eng.generate(a, max_new_tokens=2, seed=2).token_ids) == 2
    eng.close(a)
    eng.close(b)
    assert eng.table.allocator.num_free == 24
    c = eng.open_stream([1, 2, 3])
    assert len(eng.generate(c, max_new_tokens=4).token_ids) == 4 and not eng._requests


def test_a_refused_request_list_submits_nothing(tiny_model_path):
    eng = Engine(str(tiny_model_path), kv_slots=64, max_streams=4)
    a = eng.open_stream([1, 2, 3])
    with pytest.raises(RuntimeError, match="already generating"):
        eng.generate_many([(a, SamplingParams(max_new_tokens=2)), (a, SamplingParams(max_new_tokens=2))])
    assert not eng._requests
    eng.close(a)


def test_token_ids_are_checked_where_they_enter(tiny_model_path):
    """Issue 25 E2: ids >= vocab, negative ids and non-integers were accepted, then failed a step."""
    eng = Engine(str(tiny_model_path), kv_slots=64, max_streams=4)
    for ids, bad in (([1, 99999], "99999"), ([-1], "-1"), ([1, "a"], "'a'"), ([1.5], "1.5"), ([True], "True")):
        with pytest.raises(ValueError, match=f"open_stream: .*{bad}"):
            eng.open_stream(ids)
    with pytest.raises(ValueError, match="open_stream: .*99999"):
        eng.open_stream(StreamLedger([3, 99999]))
    assert not eng.table.streams
    assert eng.vocab_size == eng.runner.model.get_input_embeddings().weight.shape[0] == 320
    sid = eng.open_stream([1, 2, np.int64(3)])
    with pytest.raises(ValueError, match=f"stream {sid}: token id {eng.vocab_size} "):
        eng.append(sid, [4, eng.vocab_size])
    with pytest.raises(ValueError, match=f"stream {sid} \\(forced tokens\\): token id -2"):
        eng.generate(sid, forced_token_ids=[5, -2])
    assert eng.ledger(sid).token_ids == [1, 2, 3] and not eng._requests
    assert len(eng.generate(sid, max_new_tokens=2, temperature=0).token_ids) == 2


def test_an_id_that_slips_past_the_checks_fails_only_its_request(tiny_model_path):
    """Issue 25 E2's repro: a bad id reaching the forward (here through a caller-held ledger,
    written behind the engine's back) used to leak its step's slots and corrupt the other
    streams of the batch."""
    eng = Engine(str(tiny_model_path), kv_slots=64, max_streams=4)
    good = eng.open_stream(list(range(30, 40)))
    ledger = StreamLedger([1, 2])
    bad = eng.open_stream(ledger)
    ledger.append([99999])
    with pytest.raises(IndexError):
        eng.generate_many([(good, SamplingParams(max_new_tokens=4, temperature=0)),
                           (bad, SamplingParams(max_new_tokens=4, temperature=0))])
    fresh = Engine(str(tiny_model_path), kv_slots=64, max_streams=4)
    f = fresh.open_stream(list(range(30, 40)))
    fresh.generate(f, max_new_tokens=4, temperature=0)
    assert eng.ledger(good).to_record() == fresh.ledger(f).to_record()  # good ran on as if alone
    assert eng.generate(good, max_new_tokens=6, temperature=0) == fresh.generate(f, max_new_tokens=6, temperature=0)
    eng.close(good)
    eng.close(bad)
    assert eng.table.allocator.num_free == 64


def test_an_over_long_context_fails_its_request_only_and_leaks_nothing(tiny_model_path):
    """Issue 25 E3: exceeding max_context raised after the step's slots were allocated."""
    eng = Engine(str(tiny_model_path), kv_slots=64, max_streams=4, max_context=16)
    s1, s2 = eng.open_stream(list(range(30, 40))), eng.open_stream(list(range(20)))
    with pytest.raises(RuntimeError, match="max_context=16"):  # a ContextLengthError
        eng.generate_many([(s1, SamplingParams(max_new_tokens=4, seed=0)), (s2, SamplingParams(max_new_tokens=4,
                                                                                                seed=1))])
    solo = Engine(str(tiny_model_path), kv_slots=64, max_streams=4, max_context=16)
    x = solo.open_stream(list(range(30, 40)))
    solo.generate(x, max_new_tokens=4, seed=0)
    assert eng.ledger(s1).to_record() == solo.ledger(x).to_record()  # s1 ran on as if alone
    assert eng.ledger(s2).num_computed == 0
    eng.close(s1)
    eng.close(s2)
    assert eng.table.allocator.num_free == 64 and issubclass(ContextLengthError, RuntimeError)


def test_evict_refuses_non_integer_spans(tiny_model_path):
    """Issue 25 m1: (1.7, 2.2) used to be truncated to [1, 2); refused now (by the ledger's
    ``check_spans``), nothing changed. Integer types other than int are fine."""
    eng = Engine(str(tiny_model_path), kv_slots=64, max_streams=4)
    sid = eng.open_stream(list(range(10)))
    eng.generate(sid, max_new_tokens=2, seed=0)
    before = engine_state(eng)
    for spans in ([(1.7, 2.2)], [(1, 2.0)], [("1", "2")], [(1, 2, 3)]):
        with pytest.raises(EvictionError, match="pairs of integers"):
            eng.evict(sid, spans)
    assert engine_state(eng) == before
    assert eng.evict(sid, [(np.int64(1), np.int32(3))]) == 2


def test_a_cancelled_waiter_stops_its_generation(tiny_model_path):
    eng = Engine(str(tiny_model_path), kv_slots=256, max_streams=4)
    a, b = eng.open_stream(list(range(20))), eng.open_stream(list(range(30, 40)))

    async def main():
        task = asyncio.create_task(eng.agenerate(a, max_new_tokens=50, seed=0))
        other = asyncio.create_task(eng.agenerate(b, max_new_tokens=6, seed=1))
        for _ in range(3):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        eng.close(a)  # its request is dropped, between two steps
        assert a not in eng._requests
        return await other

    assert len(asyncio.run(main()).token_ids) == 6
    assert not eng._requests and eng.table.allocator.num_used == eng.ledger(b).num_live

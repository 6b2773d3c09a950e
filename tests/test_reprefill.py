"""Re-prefill under new weights (issue 7's ``reprefill`` option): after ``update_weights`` the
engine can recompute the kept KV of its streams so that what it samples next is exactly what the
trainer's replay of the stream under the new policy scores."""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from envs.rollout.client import BuiltinClient
from kvstreams_sglang.engine import Engine, SamplingParams
from kvstreams_sglang.kv4.quant import dequantize_int4, dequantize_int8
from trainer_masks.scoring import stream_logprobs


@pytest.fixture(scope="module")
def new_weights(tiny_model_path):
    """The tiny model's parameters, perturbed: the 'next policy' of a weight update."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    return {n: (p + 0.05 * torch.randn(p.shape, generator=g)).detach() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def new_model(tiny_model_path, new_weights):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation="sdpa")
    model.load_state_dict(new_weights, strict=False)
    return model.eval()


def build_stream(eng, offset=0):
    """Appends, generations and evictions (one of them evicts tokens that later tokens were
    computed with), ending with the last sampled token pending."""
    sid = eng.open_stream(list(range(30 + offset, 70 + offset)))
    eng.generate(sid, max_new_tokens=6, seed=0 + offset)
    eng.append(sid, list(range(100, 120)))
    eng.generate(sid, max_new_tokens=6, seed=1 + offset)
    eng.evict(sid, [(5, 20), (45, 55)])
    eng.append(sid, list(range(140, 150)))
    eng.generate(sid, max_new_tokens=5, seed=2 + offset)
    eng.evict(sid, [(60, 70)])
    return sid


def new_policy_diffs(model, record, version=1):
    """|sampler - trainer| logprob at every token sampled by policy ``version``."""
    with torch.no_grad():
        ref = stream_logprobs(model, record)
    idx = [i for i, v in enumerate(record.policy_versions) if v == version]
    assert idx
    return [abs(float(ref[i]) - record.logprobs[i]) for i in idx]


def snapshot(eng):
    return {sid: (list(st.slots), list(st.positions), st.ledger.num_computed, list(st.ledger.token_ids),
                  list(st.ledger.evictions)) for sid, st in eng.table.streams.items()}


@pytest.mark.parametrize("reprefill", [False, True])
def test_reprefill_makes_the_sampler_replay_the_new_policy(tiny_model_path, new_weights, new_model, reprefill):
    eng = Engine(str(tiny_model_path), kv_slots=2048)
    a = build_stream(eng)
    eng.prefill(a)  # stream a: nothing pending
    b = build_stream(eng, offset=3)
    eng.append(b, list(range(160, 170)))  # stream b: the last sampled token and 10 env tokens pending
    len_a, len_b, pending_b = len(eng.stream_record(a)), len(eng.stream_record(b)), eng.table.get(b).ledger.num_pending
    assert pending_b == 11
    before, used = snapshot(eng), eng.table.allocator.num_used
    assert eng.update_weights(new_weights) == 1
    if reprefill:
        # (c) the count is every computed token, evicted ones included: the record length
        assert eng.reprefill([a]) == len_a
        assert eng.reprefill() == len_a + len_b - pending_b  # both streams, packed in one forward
        assert eng.stats.tokens_reprefilled_on_update == eng.stats.tokens_reprefilled == 2 * len_a + len_b - pending_b
    else:
        assert eng.stats.tokens_reprefilled == 0
    # nothing but the KV bytes changed: same slots, positions, pending tokens, history
    assert snapshot(eng) == before and eng.table.allocator.num_used == used
    eng.append(a, list(range(170, 175)))
    eng.generate_many([(a, SamplingParams(max_new_tokens=8, seed=5)), (b, SamplingParams(max_new_tokens=8, seed=6))])
    for sid in (a, b):
        diffs = new_policy_diffs(new_model, eng.stream_record(sid))
        if reprefill:
            assert max(diffs) <= 1e-5  # (b) the engine's KV is the new policy's replay
        else:
            assert max(diffs) > 1e-2  # (a) old-policy KV: the sampler is off the trainer's replay


def test_reprefill_with_a_generation_in_flight(tiny_model_path, new_weights, new_model):
    """The async loop updates weights while episodes are mid-generation: the client's
    ``reprefill_streams`` recomputes those streams too, between two scheduler steps."""
    eng = Engine(str(tiny_model_path), kv_slots=2048)
    client = BuiltinClient(eng)
    sid = build_stream(eng)
    eng.append(sid, list(range(180, 190)))
    seen = {}

    async def main():
        task = asyncio.create_task(client.generate(sid, SamplingParams(max_new_tokens=12, seed=9)))
        for _ in range(6):
            await asyncio.sleep(0)  # let the engine loop run a few steps
        assert sid in eng._requests  # still generating
        st = eng.table.get(sid)
        seen["pending"], seen["computed"] = st.ledger.num_pending, st.ledger.num_computed
        eng.update_weights(new_weights)
        seen["count"] = await client.reprefill_streams()
        return await task

    gen = asyncio.run(main())
    assert len(gen.token_ids) == 12 and seen["pending"] == 1 and seen["count"] == seen["computed"]
    rec = eng.stream_record(sid)
    new_tokens = rec.policy_versions[-12:]
    assert 0 in new_tokens and 1 in new_tokens  # the update landed mid-generation
    assert max(new_policy_diffs(new_model, rec)) <= 1e-5


def kv4_int4_vs_int8_keys(cache, slot, side):
    """Dequantised (rotated) keys of one token from its INT4 entry and from its INT8 side copy."""
    idx = torch.tensor([slot])
    k4 = dequantize_int4(cache.int4_k(idx))
    k8 = dequantize_int8(cache.int8_k(torch.tensor([side])))
    return k4, k8


def test_kv4_reprefill_tracks_the_new_policy(tiny_model_path, new_weights, new_model):
    """(d) KV4 pool: INT4 codes and INT8 side copies are rewritten, and what it samples next is
    within KV4 quantisation error of the exact (full-precision) new-policy replay -- loose
    tolerance: max |diff| < 0.1 nat, as for the KV4 engine without updates."""
    results = {}
    for reprefill in (False, True):
        eng = Engine(str(tiny_model_path), kv_dtype="kv4rl", kv_slots=256, max_streams=2, sink=4, recent=8,
                     dtype=torch.float32)
        sid = eng.open_stream(list(range(30, 60)))
        eng.generate(sid, max_new_tokens=4, seed=0)
        eng.append(sid, list(range(100, 110)))
        eng.evict(sid, [(6, 16)])
        eng.generate(sid, max_new_tokens=3, seed=1)
        eng.append(sid, list(range(140, 146)))
        eng.update_weights(new_weights)
        st = eng.table.get(sid)
        if reprefill:
            cache = eng.pool.layers[1]
            recent_pos = st.positions[-1]  # in the INT8 ring and in INT4
            slot, side = st.slots[-1], eng.pool.side_slot(st.row, recent_pos)
            old4, old8 = kv4_int4_vs_int8_keys(cache, slot, side)
            assert eng.reprefill() == st.ledger.num_computed
            new4, new8 = kv4_int4_vs_int8_keys(cache, slot, side)
            # both copies moved to the new policy's key (and agree with each other again)
            assert (new4 - old4).abs().max() > 0.05 and (new8 - old8).abs().max() > 0.05
            assert (new4 - new8).abs().max() < 0.1 * new8.abs().max()
        eng.generate(sid, max_new_tokens=6, seed=3)
        results[reprefill] = new_policy_diffs(new_model, eng.stream_record(sid))
    with_rp, without = results[True], results[False]
    print(f"kv4rl vs new-policy replay: max |diff| {max(with_rp):.4f} with reprefill, {max(without):.4f} without")
    assert max(with_rp) < 0.1
    assert sum(with_rp) / len(with_rp) < sum(without) / len(without) / 3


def test_reprefill_of_an_unknown_stream_changes_nothing(tiny_model_path, new_weights):
    eng = Engine(str(tiny_model_path), kv_slots=1024)
    sid = build_stream(eng)
    eng.update_weights(new_weights)
    before, k0, stats = snapshot(eng), eng.pool.k[0].clone(), eng.stats.tokens_reprefilled
    with pytest.raises(KeyError, match="no open stream 99"):
        eng.reprefill([sid, 99])  # the valid one is not recomputed either
    with pytest.raises(TypeError, match="list of stream ids"):
        eng.reprefill(sid)
    assert snapshot(eng) == before and torch.equal(eng.pool.k[0], k0) and eng.stats.tokens_reprefilled == stats
    eng.close(sid)
    with pytest.raises(KeyError, match=f"no open stream {sid}"):
        eng.reprefill([sid])
    assert eng.reprefill() == 0  # no open stream: nothing to do


"""The built-in engine: exact logprobs, in-place eviction, no re-prefill, no KV flush."""

import asyncio
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvstreams_sglang.engine import Engine, SamplingParams
from trainer_masks.scoring import stream_logprobs


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation="sdpa").eval()


def hand_mask(record):
    """Visibility by hand: causal, minus keys evicted before the query was computed."""
    n = len(record.token_ids)
    mask = torch.ones(n, n, dtype=torch.bool).tril()
    for ev in record.evictions:
        for start, end in ev.spans:
            mask[ev.at_index:, start:end] = False
    return mask


def reference_logprobs(model, record):
    """HF forward of the whole stream with explicit positions and the hand-built mask."""
    ids = torch.tensor(record.token_ids)[None]
    pos = torch.tensor(record.positions)[None]
    mask = hand_mask(record)[None, None]
    with torch.no_grad():
        logits = model(input_ids=ids, position_ids=pos, attention_mask=mask).logits[0]
    lp = torch.log_softmax(logits.float(), -1)
    return {i: float(lp[i - 1, record.token_ids[i]]) for i in range(1, len(record.token_ids))
            if record.sources[i] == "model"}


def max_diff(model, record):
    ref = reference_logprobs(model, record)
    return max(abs(ref[i] - record.logprobs[i]) for i in ref)


def test_logprobs_without_eviction_equal_transformers(tiny_model_path, hf_model):
    eng = Engine(str(tiny_model_path), kv_slots=2048)
    sid = eng.open_stream(list(range(30, 90)))
    eng.generate(sid, max_new_tokens=12, seed=0)
    eng.append(sid, list(range(100, 120)))
    eng.generate(sid, max_new_tokens=6, seed=1)
    assert max_diff(hf_model, eng.stream_record(sid)) <= 1e-5


def test_generation_after_eviction_equals_masked_reference(tiny_model_path, hf_model):
    eng = Engine(str(tiny_model_path), kv_slots=2048)
    sid = eng.open_stream(list(range(30, 70)))
    eng.generate(sid, max_new_tokens=8, seed=0)
    eng.append(sid, list(range(100, 130)))
    eng.generate(sid, max_new_tokens=8, seed=1)
    live = eng.live_tokens(sid)
    assert eng.evict(sid, [(5, 25), (48, 60)]) == 32  # the sampled-but-pending last token stays
    assert eng.live_tokens(sid) == live - 32
    eng.append(sid, list(range(140, 150)))
    eng.generate(sid, max_new_tokens=8, seed=2)
    eng.evict(sid, [(30, 40)])
    eng.generate(sid, max_new_tokens=5, seed=3)
    rec = eng.stream_record(sid)
    # 40 + 8 + 30 + 8 = 86 tokens, the last sampled one pending: at_index = 85 (then 85 + 1 + 10 + 8 - 1).
    assert [ev.at_index for ev in rec.evictions] == [85, 103] and rec.positions == list(range(len(rec)))
    assert max_diff(hf_model, rec) <= 1e-5


def test_random_appends_and_evictions_never_reprefill(tiny_model_path, hf_model):
    rng = random.Random(0)
    eng = Engine(str(tiny_model_path), kv_slots=4096)
    sid = eng.open_stream([rng.randrange(256) for _ in range(20)])
    for turn in range(8):
        eng.generate(sid, max_new_tokens=rng.randint(1, 6), seed=turn)
        eng.append(sid, [rng.randrange(256) for _ in range(rng.randint(1, 15))])
        st = eng.table.get(sid)
        evictable = [p for p in st.positions if p >= 20]
        if turn % 2 and len(evictable) > 4:
            a = rng.choice(evictable[:-3])
            eng.evict(sid, [(a, a + 1)] if a + 1 not in evictable else [(a, a + 2)])
    eng.generate(sid, max_new_tokens=3, seed=99)
    st = eng.table.get(sid)
    assert eng.stats.tokens_reprefilled == 0
    assert eng.stats.tokens_prefilled + eng.stats.tokens_decoded == st.ledger.num_computed
    assert max_diff(hf_model, eng.stream_record(sid)) <= 1e-5


def test_invalid_evict_leaves_stream_and_pool_unchanged(tiny_model_path):
    eng = Engine(str(tiny_model_path), kv_slots=512)
    sid = eng.open_stream(list(range(40)))
    eng.generate(sid, max_new_tokens=4, seed=0)
    st = eng.table.get(sid)
    before = (list(st.slots), list(st.positions), eng.table.allocator.num_free, eng.pool.k[0].clone())
    with pytest.raises(ValueError, match="pending"):
        eng.evict(sid, [(10, 20), (40, 44)])  # the last sampled token (43) has no KV yet
    assert (st.slots, st.positions, eng.table.allocator.num_free) == before[:3]
    assert torch.equal(eng.pool.k[0], before[3])


def test_batched_generation_equals_one_stream_at_a_time(tiny_model_path):
    prompts = [list(range(30, 30 + n)) for n in (7, 25, 12)]
    eng = Engine(str(tiny_model_path), kv_slots=2048)
    sids = [eng.open_stream(p) for p in prompts]
    together = eng.generate_many([(s, SamplingParams(max_new_tokens=9, seed=i)) for i, s in enumerate(sids)])
    for i, p in enumerate(prompts):
        solo = Engine(str(tiny_model_path), kv_slots=2048)
        g = solo.generate(solo.open_stream(p), max_new_tokens=9, seed=i)
        assert g.token_ids == together[i].token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, together[i].logprobs, strict=True)) <= 1e-5


def test_async_streams_share_steps(tiny_model_path):
    eng = Engine(str(tiny_model_path), kv_slots=4096)

    async def episode(i):
        sid = eng.open_stream(list(range(40 + i, 60 + i)))
        out = []
        for turn in range(3):
            g = await eng.agenerate(sid, max_new_tokens=4 + i, seed=10 * i + turn)
            out.append(g.token_ids)
            eng.append(sid, [65 + turn] * 5)
        return out

    async def main():
        return await asyncio.gather(*(episode(i) for i in range(6)))

    outs = asyncio.run(main())
    assert all(len(o) == 3 for o in outs)
    decode_tokens = sum(4 + i for i in range(6)) * 3 - 6 * 3  # first token of each turn comes from an extend
    assert eng.stats.steps < decode_tokens  # streams were batched, not run one by one


def test_update_weights_keeps_kv_and_stamps_versions(tiny_model_path):
    eng = Engine(str(tiny_model_path), kv_slots=1024)
    sid = eng.open_stream(list(range(50)))
    eng.generate(sid, max_new_tokens=3, seed=0)
    live, k_before = eng.live_tokens(sid), eng.pool.k[1].clone()
    new = {n: p + 0.01 for n, p in eng.runner.model.named_parameters()}
    assert eng.update_weights(new) == 1
    assert eng.live_tokens(sid) == live and torch.equal(eng.pool.k[1], k_before)  # no flush
    eng.generate(sid, max_new_tokens=3, seed=0)
    rec = eng.stream_record(sid)
    assert [v for v in rec.policy_versions if v is not None] == [0, 0, 0, 1, 1, 1]
    with pytest.raises(KeyError, match="unknown"):
        eng.update_weights({"not.a.weight": torch.zeros(1)})


def test_sampling_is_seeded_and_respects_top_k(tiny_model_path):
    eng = Engine(str(tiny_model_path), kv_slots=1024)
    a = eng.generate(eng.open_stream([1, 2, 3]), max_new_tokens=8, seed=7)
    b = eng.generate(eng.open_stream([1, 2, 3]), max_new_tokens=8, seed=7)
    assert a.token_ids == b.token_ids
    greedy = eng.generate(eng.open_stream([1, 2, 3]), max_new_tokens=5, temperature=0)
    top1 = eng.generate(eng.open_stream([1, 2, 3]), max_new_tokens=5, top_k=1, seed=3)
    assert greedy.token_ids == top1.token_ids
    stop = eng.generate(eng.open_stream([1, 2, 3]), max_new_tokens=50, stop_token_ids=[greedy.token_ids[0]],
                        temperature=0)
    assert stop.token_ids == greedy.token_ids[:1] and stop.finish_reason == "stop"


def test_forcing_the_greedy_tokens_reproduces_the_greedy_run(tiny_model_path):
    eng = Engine(str(tiny_model_path), kv_slots=1024)
    greedy = eng.generate(eng.open_stream(list(range(30, 50))), max_new_tokens=8, temperature=0)
    forced = eng.generate(eng.open_stream(list(range(30, 50))), forced_token_ids=greedy.token_ids)
    assert forced == greedy  # tokens, logprobs (bit for bit) and finish reason


def test_forced_tokens_report_their_logprobs_under_the_model(tiny_model_path, hf_model):
    """Teacher forcing: each forced token goes through a decode step and is reported with its
    logprob under the (tempered) model distribution, as a sampled token is; here against the
    fp32 HF model scoring the same stream."""
    tokens = [7, 200, 13, 99, 250, 1]
    eng = Engine(str(tiny_model_path), kv_slots=1024)
    sid = eng.open_stream(list(range(30, 50)))
    g = eng.generate(sid, forced_token_ids=tokens, seed=3)
    assert g.token_ids == tokens and g.finish_reason == "length"
    assert eng.stats.steps == len(tokens)  # the prompt's extend samples the first, then one decode step each
    rec = eng.stream_record(sid)
    sampled = [i for i, s in enumerate(rec.sources) if s == "model"]
    with torch.no_grad():
        ref = stream_logprobs(hf_model, rec, impl="sdpa")
    assert max(abs(float(ref[i]) - lp) for i, lp in zip(sampled, g.logprobs, strict=True)) <= 1e-5
    hot = eng.generate(eng.open_stream(list(range(30, 50))), forced_token_ids=tokens, temperature=0.5)
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor(rec.token_ids)[None]).logits[0].float()
    tempered = torch.log_softmax(logits / 0.5, -1)[[i - 1 for i in sampled], tokens]
    assert max(abs(float(a) - b) for a, b in zip(tempered, hot.logprobs, strict=True)) <= 1e-5


def test_kv4rl_engine_tracks_the_bf16_engine(tiny_model_path, hf_model, device):
    eng = Engine(str(tiny_model_path), kv_dtype="kv4rl", kv_slots=1024, max_streams=4, device=device,
                 dtype=torch.float32)
    sid = eng.open_stream(list(range(30, 230)))  # longer than sink + recent: both regions in use
    eng.generate(sid, max_new_tokens=4, seed=0)
    eng.append(sid, list(range(100, 110)))
    eng.evict(sid, [(20, 60)])
    eng.generate(sid, max_new_tokens=4, seed=1)
    rec = eng.stream_record(sid)
    diff = max_diff(hf_model, rec)
    print(f"kv4rl vs exact logprobs on a random tiny model: max abs diff {diff:.4f}")
    assert diff < 0.1 and eng.stats.tokens_reprefilled == 0


def test_llama_checkpoints_load_and_match_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    eng = Engine(str(tmp_path / "llama"), kv_slots=1024)
    sid = eng.open_stream(list(range(10, 60)))
    eng.generate(sid, max_new_tokens=6, seed=0)
    eng.append(sid, list(range(70, 80)))
    eng.evict(sid, [(5, 30)])
    eng.generate(sid, max_new_tokens=6, seed=1)
    ref_model = LlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    assert max_diff(ref_model, eng.stream_record(sid)) <= 1e-5


def test_kv4rl_cpu_reference_path_equals_the_triton_kernels(tiny_model_path, device):
    """The engine's KV4 torch path (``kv4.reference``, used on CPU) and the Triton kernels
    (interpreted on CPU) sample the same tokens with the same logprobs: two streams batched,
    both regions in use, an eviction in between. Up to rounding: the kernels rotate by a matmul,
    the reference by butterflies, so an INT8/INT4 code can land on the other side of a rounding
    boundary (the KV4 error itself is ~1e-2 here, see the test above)."""
    from kvstreams_sglang.engine.attention import KV4Backend

    records = {}
    for impl in ("torch", "triton"):
        eng = Engine(str(tiny_model_path), kv_dtype="kv4rl", kv_slots=1024, max_streams=4, recent=32,
                     dtype=torch.float32, device=device)
        eng.backend = KV4Backend(eng.pool, impl=impl, num_q_heads=eng.runner.num_heads)
        sids = [eng.open_stream(list(range(30, 110))), eng.open_stream(list(range(40, 90)))]
        eng.generate_many([(s, SamplingParams(max_new_tokens=3, seed=i)) for i, s in enumerate(sids)])
        eng.append(sids[0], list(range(100, 110)))
        eng.evict(sids[0], [(20, 40)])
        eng.generate_many([(s, SamplingParams(max_new_tokens=3, seed=10 + i)) for i, s in enumerate(sids)])
        records[impl] = [eng.stream_record(s) for s in sids]
    for ref, kernel in zip(records["torch"], records["triton"], strict=True):
        assert ref.token_ids == kernel.token_ids
        diffs = [abs(a - b) for a, b in zip(ref.logprobs, kernel.logprobs, strict=True) if a is not None]
        assert len(diffs) == 6 and max(diffs) < 1e-3


def test_an_engine_on_a_loaded_model_reports_each_step(tiny_model_path):
    """``Engine(model=...)`` runs an already-loaded model (engines with different pools can share one) exactly as
    ``Engine(path)`` does; ``on_step`` sees every scheduler step (what the benchmarks time)."""
    from kvstreams_sglang.engine.model_runner import load_model

    model = load_model(str(tiny_model_path), device="cpu", dtype=torch.float32)[0]
    steps = []
    shared = Engine(model=model, kv_slots=256, max_streams=2, on_step=steps.append)
    loaded = Engine(str(tiny_model_path), kv_slots=256, max_streams=2, dtype=torch.float32)
    prompt = list(range(10, 30))
    a = shared.generate(shared.open_stream(prompt), max_new_tokens=4, temperature=0.0)
    b = loaded.generate(loaded.open_stream(prompt), max_new_tokens=4, temperature=0.0)
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    # the prompt in one extend, then one decode per sampled token but the last (still pending)
    assert [(s.mode, s.streams, s.tokens) for s in steps] == [("extend", 1, 20)] + [("decode", 1, 1)] * 3
    assert [s.live_slots for s in steps] == [20, 21, 22, 23] == [s.max_stream_slots for s in steps]
    assert all(s.seconds > 0 for s in steps)
    with pytest.raises(ValueError, match="exactly one"):
        Engine(str(tiny_model_path), model=model)

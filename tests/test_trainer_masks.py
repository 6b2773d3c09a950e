"""The trainer replays a KV stream in one forward pass and scores every token exactly as the
engine sampled it: key ``k`` is visible to query ``q`` iff ``k <= q < death[k]``."""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_mask
from transformers import AutoModelForCausalLM, DynamicCache, Qwen3ForCausalLM

from trainer_masks import (
    EvictionEvent,
    StreamRecord,
    context_windows,
    dense_mask,
    flex_block_mask,
    flex_mask_mod,
    pack,
    reprefill_segments,
    reprefilled_tokens,
)
from trainer_masks.scoring import score_streams, stream_logprobs
from trainer_masks.scoring.logprobs import resolve_impl, token_logprobs_and_entropy


def make_record(token_ids, evictions=(), sources=None) -> StreamRecord:
    """A record as the sampler would write it: loss and sampler logprobs on model tokens only.
    ``evictions`` are ``(at_index, [(start, end), ...])`` pairs."""
    n = len(token_ids)
    sources = sources or ["model"] * n
    model = [s == "model" for s in sources]
    return StreamRecord(
        token_ids=list(token_ids),
        positions=list(range(n)),
        sources=sources,
        loss_mask=model,
        logprobs=[-1.0 if m else None for m in model],
        policy_versions=[3 if m else None for m in model],
        evictions=[EvictionEvent(at_index=at, spans=tuple(spans)) for at, spans in evictions],
    )


def random_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# An episode: prompt, model turn, env observation, model turn. The first compaction (before token 9)
# evicts part of the first model turn; the second (before 15) evicts the prompt head and the observation.
EPISODE_SOURCES = ["prompt"] * 4 + ["model"] * 5 + ["env"] * 3 + ["model"] * 8
EPISODE_EVICTIONS = [(9, [(4, 7)]), (15, [(0, 2), (9, 11)])]


def episode(seed: int = 0) -> StreamRecord:
    return make_record(random_tokens(20, seed), EPISODE_EVICTIONS, EPISODE_SOURCES)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)


@pytest.fixture(scope="module")
def eager_model(tiny_model_path):
    """The same weights behind plain matmul attention: references share no kernel or mask code
    with the code under test."""
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32, attn_implementation="eager")


# --- the mask ---------------------------------------------------------------------------------


def test_death_is_the_at_index_of_the_evicting_event_and_stream_length_otherwise():
    record = make_record(range(12), [(5, [(1, 3)]), (9, [(0, 1), (5, 7)])])
    assert record.death() == [9, 5, 5, 12, 12, 9, 9, 12, 12, 12, 12, 12]


def test_dense_mask_is_k_le_q_lt_death_entry_by_entry():
    record = make_record(range(12), [(5, [(1, 3)]), (9, [(0, 1), (5, 7)])])
    death = record.death()
    mask = dense_mask(record)
    assert mask.shape == (12, 12) and mask.dtype == torch.bool
    for q in range(12):
        for k in range(12):
            assert mask[q, k] == (k <= q < death[k]), (q, k)
    assert mask[4, 1] and not mask[5, 1]  # evicted at 5: seen by query 4, not by query 5
    assert mask[8, 0] and not mask[9, 0]
    assert mask[5, 5] and mask[9, 9]  # a token computed after an eviction sees itself
    assert mask.sum(1).tolist() == [len(record.live_tokens_after(q)) for q in range(12)]


def test_pack_keeps_each_records_positions_and_shifts_death_into_packed_coordinates():
    a = make_record(range(6), [(4, [(0, 2)])])
    b = make_record(range(3))
    packed = pack([a, b])
    assert packed.input_ids.shape == packed.position_ids.shape == (1, 9)
    assert packed.offsets == (0, 6) and packed.lengths == (6, 3)
    assert packed.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert packed.document_ids.tolist() == [0] * 6 + [1] * 3
    assert packed.death.tolist() == [4, 4, 6, 6, 6, 6, 9, 9, 9]
    assert packed.loss_mask.tolist() == [True] * 9


def test_packed_mask_is_block_diagonal_with_each_records_own_mask():
    records = [episode(0), make_record(range(5)), make_record(range(7), [(6, [(2, 4)])])]
    packed = pack(records)
    assert torch.equal(packed.dense_mask(), torch.block_diag(*[dense_mask(r) for r in records]))


def test_flex_mask_mod_evaluated_everywhere_equals_the_dense_mask():
    packed = pack([episode(0), make_record(range(5)), make_record(range(7), [(6, [(2, 4)])])])
    mask_mod = flex_mask_mod(packed.document_ids, packed.death)
    n = len(packed)
    assert torch.equal(create_mask(mask_mod, None, None, n, n, device="cpu")[0, 0], packed.dense_mask())


def test_flex_block_mask_keeps_exactly_the_blocks_holding_a_visible_key():
    packed = pack([episode(0), make_record(range(5)), make_record(range(7), [(6, [(2, 4)])])])
    block_mask = flex_block_mask(packed, "cpu", block_size=4)
    n = len(packed)  # 32: whole blocks
    dense = packed.dense_mask().reshape(n // 4, 4, n // 4, 4)
    assert torch.equal(block_mask.to_dense()[0, 0].bool(), dense.any(3).any(1))
    assert not dense.any(3).any(1).all()  # the property is not vacuous: some blocks are skipped


# --- scoring ------------------------------------------------------------------------------------


# transformers 5.24 renamed `past_key_values` to `cache`; the GPU image has an older release
CACHE_KWARG = "cache" if "cache" in inspect.signature(Qwen3ForCausalLM.forward).parameters else "past_key_values"


def engine_replay(model, record: StreamRecord) -> torch.Tensor:
    """Reference: run the stream the way the inference engine does, one token at a time into a KV
    cache, deleting evicted entries from the cache before the token at ``at_index`` is computed.
    Returns the next-token logits after every token, ``[T, V]``."""
    cache = DynamicCache(config=model.config)
    slots: list[int] = []  # stream index held by each cache entry
    logits = []
    for i, token in enumerate(record.token_ids):
        evicted = {k for ev in record.evictions if ev.at_index == i for s, e in ev.spans for k in range(s, e)}
        if evicted:
            keep = torch.tensor([j for j, k in enumerate(slots) if k not in evicted])
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, keep], layer.values[:, :, keep]
            slots = [slots[j] for j in keep]
        slots.append(i)
        out = model(
            input_ids=torch.tensor([[token]]),
            position_ids=torch.tensor([[record.positions[i]]]),
            attention_mask={"full_attention": None},  # one query attends every entry left in the cache
            **{CACHE_KWARG: cache},
            use_cache=True,
        )
        logits.append(out.logits[0, -1])
    return torch.stack(logits)


def shifted_scores(logits: torch.Tensor, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of token i and entropy of its distribution, from the logits after token i - 1."""
    logp = torch.log_softmax(logits[:-1].double(), -1)
    targets = torch.tensor(token_ids[1:])[:, None]
    logprobs = F.pad(logp.gather(-1, targets).squeeze(-1), (1, 0))
    entropy = F.pad(-(logp.exp() * logp).sum(-1), (1, 0))
    return logprobs.float(), entropy.float()


@torch.no_grad()
def test_one_masked_forward_scores_like_the_engine_that_evicted_in_place(model, eager_model):
    record = episode(0)
    expected_logprobs, expected_entropy = shifted_scores(engine_replay(eager_model, record), record.token_ids)
    scores = score_streams(model, [record], impl="sdpa")[0]
    assert scores.logprobs.dtype == scores.entropy.dtype == torch.float32
    torch.testing.assert_close(scores.logprobs, expected_logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(scores.entropy, expected_entropy, atol=1e-5, rtol=0)
    assert scores.loss_mask.tolist() == record.loss_mask


@torch.no_grad()
def test_scores_follow_the_recorded_positions_gaps_included(model, eager_model):
    # RoPE is relative, so only gaps matter: here 40 positions are skipped before token 10
    contiguous = episode(3)
    gapped = contiguous.model_copy(update={"positions": list(range(10)) + list(range(50, 60))})
    expected, _ = shifted_scores(engine_replay(eager_model, gapped), gapped.token_ids)
    scored = stream_logprobs(model, gapped, impl="sdpa")
    torch.testing.assert_close(scored, expected, atol=1e-5, rtol=0)
    assert (scored - stream_logprobs(model, contiguous, impl="sdpa"))[11:].abs().min() > 1e-4


@torch.no_grad()
def test_evictions_change_exactly_the_scores_of_tokens_computed_after_them(model):
    record = episode(0)
    uncompacted = make_record(record.token_ids, (), EPISODE_SOURCES)
    diff = (stream_logprobs(model, record, impl="sdpa") - stream_logprobs(model, uncompacted, impl="sdpa")).abs()
    # token i is predicted by query i - 1; the first eviction applies to queries >= 9
    assert diff[:10].max() == 0
    assert diff[10:].min() > 1e-4  # so the 1e-5 parity tests above and below can fail


@torch.no_grad()
def test_a_tokens_score_does_not_depend_on_tokens_after_it(model):
    record = episode(1)
    full = stream_logprobs(model, record, impl="sdpa")
    mask = dense_mask(record)
    for q in range(len(record) - 1):
        # only rows 0..q of the mask: each key's hidden states are computed under its own row
        logits = model(
            input_ids=torch.tensor([record.token_ids[: q + 1]]),
            position_ids=torch.tensor([record.positions[: q + 1]]),
            attention_mask={"full_attention": mask[: q + 1, : q + 1][None, None]},
        ).logits[0, -1]
        expected = torch.log_softmax(logits.float(), -1)[record.token_ids[q + 1]]
        assert abs(full[q + 1].item() - expected.item()) <= 1e-5, q


@torch.no_grad()
def test_packing_records_together_scores_each_as_if_alone(model):
    records = [
        episode(2),
        make_record(random_tokens(7, 3)),
        make_record(random_tokens(13, 4), [(6, [(1, 4)]), (11, [(4, 9)])]),
        make_record(random_tokens(1, 5)),  # a lone token has no prediction
    ]
    together = score_streams(model, records, impl="sdpa")
    for record, scores in zip(records, together, strict=True):
        alone = score_streams(model, [record], impl="sdpa")[0]
        assert scores.logprobs.shape == (len(record),)
        torch.testing.assert_close(scores.logprobs, alone.logprobs, atol=1e-5, rtol=0)
        torch.testing.assert_close(scores.entropy, alone.entropy, atol=1e-5, rtol=0)
        assert scores.logprobs[0] == scores.entropy[0] == 0
    assert isinstance(stream_logprobs(model, records, impl="sdpa"), list)


@torch.no_grad()
def test_scoring_restores_the_models_attention_implementation(model):
    before = model.config._attn_implementation
    stream_logprobs(model, episode(0), impl="sdpa")
    assert model.config._attn_implementation == before


@torch.no_grad()
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's compile
def test_flex_attention_scores_equal_sdpa_scores(tiny_model_path, device):
    """Runs on the GPU when there is one. On the CPU FlexAttention runs forward only, through
    torch.compile: ~20 s the first time on two cores, a few seconds with inductor's cache warm."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).to(device)
    records = [episode(0), make_record(random_tokens(9, 6), [(5, [(0, 3)])])]
    sdpa = stream_logprobs(model, records, impl="sdpa")
    flex = stream_logprobs(model, records, impl="flex")
    for a, b in zip(sdpa, flex, strict=True):
        assert b.device.type == device.type
        torch.testing.assert_close(b, a, atol=1e-5, rtol=0)


def test_auto_uses_flex_on_cuda_and_sdpa_elsewhere():
    assert resolve_impl("auto", torch.device("cuda", 0)) == "flex"
    assert resolve_impl("auto", torch.device("cpu")) == "sdpa"
    assert resolve_impl("sdpa", torch.device("cuda", 0)) == "sdpa"
    with pytest.raises(ValueError, match="impl must be"):
        resolve_impl("eager", torch.device("cpu"))


# --- the re-prefill baseline ---------------------------------------------------------------------


def test_each_compaction_starts_a_window_that_reprefills_the_live_tokens():
    record = episode(0)
    windows = context_windows(record)
    assert [(w.start, w.end) for w in windows] == [(0, 9), (9, 15), (15, 20)]
    assert windows[0].kept == ()
    assert windows[1].kept == (0, 1, 2, 3, 7, 8) == tuple(record.live_tokens_after(9)[:-1])
    assert windows[2].kept == (2, 3, 7, 8, 11, 12, 13, 14) == tuple(record.live_tokens_after(15)[:-1])
    assert reprefilled_tokens(record) == 6 + 8


def test_reprefill_segments_restart_positions_and_train_each_model_token_once():
    record = episode(0)
    segments = reprefill_segments(record)
    assert [len(s) for s in segments] == [9, 6 + 6, 8 + 5]
    for s in segments:
        assert s.positions == list(range(len(s))) and s.evictions == []
        assert s.token_ids == [record.token_ids[k] for k in s.meta["stream_indices"]]
    kept = len(context_windows(record)[1].kept)
    assert segments[1].loss_mask == [False] * kept + [False] * 3 + [True] * 3  # env 9..11, model 12..14
    assert segments[1].logprobs[:kept] == [None] * kept
    assert segments[1].sources[:kept] == ["prompt"] * 4 + ["model"] * 2
    trained = [k for s in segments for k, m in zip(s.meta["stream_indices"], s.loss_mask, strict=True) if m]
    assert trained == [k for k in range(len(record)) if record.loss_mask[k]]


def test_every_new_token_of_a_segment_sees_the_same_tokens_as_in_the_stream():
    record = episode(0)
    for segment, window in zip(reprefill_segments(record), context_windows(record), strict=True):
        for q in range(window.start, window.end):
            local = len(window.kept) + q - window.start
            assert segment.token_ids[: local + 1] == [record.token_ids[k] for k in record.live_tokens_after(q)]


def test_compactions_at_one_index_are_one_window_and_one_at_the_end_starts_none():
    record = make_record(range(10), [(4, [(0, 1)]), (4, [(2, 3)]), (10, [(5, 8)])])
    assert [(w.kept, w.start, w.end) for w in context_windows(record)] == [((), 0, 4), ((1, 3), 4, 10)]
    assert reprefilled_tokens(record) == 2
    assert reprefilled_tokens(make_record(range(10))) == 0


# --- the record ---------------------------------------------------------------------------------


def test_record_round_trips_through_json():
    record = episode(0)
    again = StreamRecord.model_validate_json(record.model_dump_json())
    assert again == record
    assert again.death() == record.death()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"evictions": [EvictionEvent(at_index=3, spans=((2, 5),))]}, r"not inside the computed prefix \[0, 3\)"),
        (
            {"evictions": [EvictionEvent(at_index=3, spans=((0, 2),)), EvictionEvent(at_index=5, spans=((1, 4),))]},
            "stream index 1 is evicted twice",
        ),
        ({"positions": [0, 1, 2]}, "positions has 3 entries for 6 tokens"),
        (
            {"evictions": [EvictionEvent(at_index=5, spans=()), EvictionEvent(at_index=3, spans=())]},
            "out of order",
        ),
    ],
)
def test_malformed_records_are_rejected_with_the_reason(change, message):
    fields = make_record(range(6)).model_dump() | change
    with pytest.raises(ValueError, match=message):
        StreamRecord(**fields)


def test_entropy_of_a_uniform_prediction_is_log_vocab():
    logits = torch.zeros(3, 64, dtype=torch.bfloat16)
    logits[2, 10:] = -math.inf  # a masked vocabulary tail must not turn the entropy into nan
    logprobs, entropy = token_logprobs_and_entropy(logits, torch.tensor([0, 5, 3]))
    torch.testing.assert_close(logprobs, torch.tensor([-math.log(64)] * 2 + [-math.log(10)]))
    torch.testing.assert_close(entropy, torch.tensor([math.log(64)] * 2 + [math.log(10)]))

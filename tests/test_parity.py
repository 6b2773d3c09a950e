"""Trainer/sampler parity: `stream_logprobs` on an engine's StreamRecord reproduces the
engine's sampling logprobs, whatever was evicted along the way."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvstreams_sglang.engine import Engine
from kvstreams_sglang.testing.episodes import EVICTION_PATTERNS, scripted_episode
from trainer_masks.scoring import stream_logprobs


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


def diffs(record, trainer_lp):
    idx = [i for i, s in enumerate(record.sources) if s == "model"]
    sampler = torch.tensor([record.logprobs[i] for i in idx])
    return (trainer_lp[idx] - sampler).abs(), sampler - trainer_lp[idx]


@pytest.mark.parametrize("name", list(EVICTION_PATTERNS))
def test_trainer_logprobs_equal_sampler_logprobs(name, tiny_model_path, hf_model):
    eng = Engine(str(tiny_model_path), kv_slots=4096)
    record = scripted_episode(eng, **EVICTION_PATTERNS[name])
    assert record.evictions, "the pattern must evict something"
    with torch.no_grad():
        lp = stream_logprobs(hf_model, record, impl="sdpa")
    absdiff, _ = diffs(record, lp)
    print(f"{name}: {len(record)} tokens, {len(record.evictions)} evictions, max |diff| {absdiff.max():.2e}")
    assert float(absdiff.max()) <= 1e-4


def test_kv4rl_train_infer_gap_is_reported(tiny_model_path, hf_model, device):
    """The monitored gap, not a failure: KV4 storage changes what the sampler computed."""
    eng = Engine(str(tiny_model_path), kv_dtype="kv4rl", kv_slots=4096, max_streams=4, device=device,
                 dtype=torch.float32)
    record = scripted_episode(eng, **EVICTION_PATTERNS["drop_oldest_half"])
    with torch.no_grad():
        lp = stream_logprobs(hf_model, record, impl="sdpa")
    absdiff, log_ratio = diffs(record, lp)
    kl = float(log_ratio.mean())  # k1 estimate of KL(sampler || trainer) on the sampled tokens
    print(f"kv4rl vs trainer: mean |diff| {absdiff.mean():.4f}, max {absdiff.max():.4f}, token KL ~ {kl:.2e}")
    assert torch.isfinite(absdiff).all() and float(absdiff.max()) < 0.5

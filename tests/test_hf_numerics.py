"""``--hf-numerics``'s pieces that need no SGLang process: HF's modules found from a config, the RoPE lookup table
equal to HF's rotary module called on any positions, architectures it does not align refused. (The whole flag
against the built-in engine: ``test_sglang.py::test_hf_numerics_kv4rl_bf16_logprobs_equal_builtin_engine_...``.)"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from kvstreams_sglang.sglang_ext.hf_numerics import HFNumericsError, hf_modules, rope_table


def small_qwen3() -> Qwen3Config:
    return Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                       rope_theta=1e6)


def test_hf_modules_are_the_checkpoints_own():
    from transformers.models.qwen3 import modeling_qwen3

    norm, rotary, apply_rope, act = hf_modules(small_qwen3())
    assert (norm, rotary, apply_rope) == (modeling_qwen3.Qwen3RMSNorm, modeling_qwen3.Qwen3RotaryEmbedding,
                                          modeling_qwen3.apply_rotary_pos_emb)
    x = torch.randn(8)
    assert torch.equal(act(x), torch.nn.functional.silu(x))


def test_another_architecture_is_refused_with_the_reason():
    with pytest.raises(HFNumericsError, match="aligns qwen3 models.*'llama'"):
        hf_modules(LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_table_rows_equal_hf_rotary_on_any_positions(dtype):
    """A row per position, looked up, equals what HF's rotary module returns for a step's own position ids (stream
    positions with gaps, out of order, repeated), to the bit."""
    cfg = small_qwen3()
    _, rotary_cls, _, _ = hf_modules(cfg)
    cos_t, sin_t = rope_table(rotary_cls, cfg, 4096, "cpu", dtype)
    assert cos_t.shape == (4096, 32) and cos_t.dtype == dtype
    positions = torch.tensor([0, 1, 17, 4095, 2048, 17, 900, 3])
    cos, sin = rotary_cls(config=cfg)(torch.empty(0, dtype=dtype), positions[None])
    assert torch.equal(cos_t[positions], cos[0]) and torch.equal(sin_t[positions], sin[0])

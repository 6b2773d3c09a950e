"""``kernels.hf_rms_norm`` against HF's Qwen3 RMSNorm (the rounding it promises) and a float64 reference; on the
CPU under Triton's interpreter, on a GPU compiled."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from kvstreams_sglang.kernels.hf_rms_norm import hf_rms_norm, mean_factor

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def hf_norm(n: int, dtype, seed: int = 0) -> Qwen3RMSNorm:
    g = torch.Generator().manual_seed(seed)
    m = Qwen3RMSNorm(n, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(torch.randn(n, generator=g) * 0.3 + 1)
    return m.to(DEVICE, dtype)


def inputs(rows: int, n: int, dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(rows, n, generator=g) * 3).to(DEVICE, dtype),
            torch.randn(rows, n, generator=g).to(DEVICE, dtype))


def float64_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("n,rows", [(128, 48), (1024, 8), (2560, 4)])  # Qwen3's head dim, a hidden size, 4B's hidden
def test_bf16_rounds_as_hf_and_stays_within_two_roundings_of_float64(n, rows):
    m = hf_norm(n, torch.bfloat16)
    x, residual = inputs(rows, n, torch.bfloat16)
    with torch.no_grad():
        ours, hf = hf_rms_norm(x, m.weight, m.variance_epsilon), m(x)
        ours_r, total = hf_rms_norm(x, m.weight, m.variance_epsilon, residual)
        hf_r = m(residual + x)
    assert torch.equal(total, residual + x)  # the residual sum rounds in bf16, as HF adds
    for a, b in ((ours, hf), (ours_r, hf_r)):
        differ = a != b
        # the row's fp32 sum may add in another order than torch's reduction: a last fp32 bit of the variance,
        # at most one bf16 step of an output, rarely (on the CPU's interpreter: none)
        assert differ.float().mean() < 1e-3, int(differ.sum())
        step = torch.finfo(torch.bfloat16).eps * b.float().abs().clamp(min=1e-30)
        assert ((a.float() - b.float()).abs() <= step)[differ].all()
    ref = float64_reference(x, m.weight, m.variance_epsilon)
    # two bf16 roundings (the normalised value, the product): each at most half a step of 2^-8 relative
    assert ((ours.double() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-6).all()
    assert x.dtype == ours.dtype and ours.shape == x.shape


def test_fp32_equals_float64_reference_to_fp32_precision_and_shapes_are_kept():
    m = hf_norm(256, torch.float32)
    x, residual = inputs(6, 256, torch.float32)
    x3 = x.view(2, 3, 256)
    ours, total = hf_rms_norm(x3, m.weight, m.variance_epsilon, residual.view(2, 3, 256))
    assert ours.shape == total.shape == (2, 3, 256)
    ref = float64_reference(residual + x, m.weight, m.variance_epsilon)
    torch.testing.assert_close(ours.view(6, 256).double(), ref, rtol=1e-5, atol=1e-6)
    assert hf_rms_norm(x[:0], m.weight, 1e-6).shape == (0, 256)  # no rows, no launch


def test_inputs_it_does_not_round_as_hf_are_refused():
    m = hf_norm(128, torch.float32)
    with pytest.raises(ValueError, match="weight must have the input's dtype"):
        hf_rms_norm(torch.ones(2, 128, dtype=torch.bfloat16, device=DEVICE), m.weight, 1e-6)
    with pytest.raises(ValueError, match="residual"):
        hf_rms_norm(torch.ones(2, 128, device=DEVICE), m.weight, 1e-6, torch.ones(3, 128, device=DEVICE))


def test_mean_factor_is_torchs_fp32_factor():
    assert mean_factor(7, 2560) == torch.tensor(1 / 2560, dtype=torch.float32).item()
    assert mean_factor(4099, 4097) != mean_factor(1, 4097)  # a product past 2^24 that fp32 cannot hold

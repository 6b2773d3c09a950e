"""single_decode: INT4 bulk + INT8 sink/recent, against float64 attention."""

import pytest
import torch
from kv4_cases import rel_l2

from kvstreams_sglang.kernels import single_decode
from kvstreams_sglang.kv4 import (
    dequantize_int4,
    dequantize_int8,
    hadamard,
    quantize_int4,
    quantize_int8,
    split_regions,
)


def exact_attention(q, k, v):
    """float64 softmax attention, GQA: q [Hq, D], k/v [L, Hkv, D]."""
    group = q.shape[0] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    vv = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    w = torch.softmax(torch.einsum("hd,hld->hl", q.double(), kk) / q.shape[-1] ** 0.5, -1)
    return torch.einsum("hl,hld->hd", w, vv)


def dequantized_cache(k, v, sink, recent):
    """The cache single_decode builds, dequantised exactly: rotated keys, INT8 where protected."""
    kr = hadamard(k.double())
    k_hat, v_hat = dequantize_int4(quantize_int4(kr), torch.float64), dequantize_int4(quantize_int4(v), torch.float64)
    _, prot = split_regions(k.shape[0], sink=sink, recent=recent)
    k_hat[prot] = dequantize_int8(quantize_int8(kr[prot]), torch.float64)
    v_hat[prot] = dequantize_int8(quantize_int8(v[prot]), torch.float64)
    return k_hat, v_hat


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("length,hq,hkv", [(1, 4, 2), (90, 4, 4), (700, 8, 2)])
def test_single_decode_matches_float64_attention_over_its_dequantized_cache(impl, length, hq, hkv, device):
    torch.manual_seed(length + hq)
    q, k, v = torch.randn(hq, 128), torch.randn(length, hkv, 128), torch.randn(length, hkv, 128)
    out = single_decode(q.to(device), k.to(device), v.to(device), impl=impl).cpu()
    k_hat, v_hat = dequantized_cache(k, v, 16, 128)
    ref = exact_attention(hadamard(q.double()), k_hat, v_hat)  # unquantised, rotated query
    err = rel_l2(out, ref)
    print(f"{impl} L={length}: rel L2 vs float64 over dequantized cache = {err:.2e}")
    assert err <= 2e-2


def test_error_against_unquantized_attention_is_the_4bit_storage_error(device):
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 128), torch.randn(2048, 2, 128), torch.randn(2048, 2, 128)
    err = rel_l2(single_decode(q.to(device), k.to(device), v.to(device), impl="triton").cpu(), exact_attention(q, k, v))
    print(f"Gaussian data, L=2048: rel L2 vs exact float64 attention = {err:.3f}")
    assert err < 0.2


def sink_dominated_input(length=600, hq=8, hkv=2, seed=0):
    """Sinks soak up most of the attention (large keys aligned with the query) and carry
    value outliers, as attention-sink heads do in trained LLMs."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(hq, 128, generator=g)
    k = torch.randn(length, hkv, 128, generator=g)
    v = torch.randn(length, hkv, 128, generator=g)
    group = hq // hkv
    for h in range(hkv):
        direction = q[h * group:(h + 1) * group].mean(0)
        k[:4, h] += 4.0 * direction / direction.norm() * 128 ** 0.5 / 4
    v[:4, :, 5] = 80.0  # one outlier channel in the sink values
    return q, k, v


def test_protected_sinks_are_at_least_5x_closer_to_exact(device):
    q, k, v = sink_dominated_input()
    exact = exact_attention(q, k, v)
    qd, kd, vd = q.to(device), k.to(device), v.to(device)
    protected = rel_l2(single_decode(qd, kd, vd, sink=16, recent=128, impl="triton").cpu(), exact)
    int4_only = rel_l2(single_decode(qd, kd, vd, sink=0, recent=0, impl="triton").cpu(), exact)
    print(f"sink-dominated input: protected (sink=16, recent=128) {protected:.4f}, INT4 everywhere {int4_only:.4f}, "
          f"ratio {int4_only / protected:.1f}x")
    assert int4_only >= 5 * protected


def test_single_decode_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple"):
        single_decode(torch.randn(3, 128), torch.randn(4, 2, 128), torch.randn(4, 2, 128))
    with pytest.raises(ValueError, match="impl"):
        single_decode(torch.randn(4, 128), torch.randn(4, 2, 128), torch.randn(4, 2, 128), impl="cuda")

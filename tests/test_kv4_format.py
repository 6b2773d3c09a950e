"""The KV4 storage format: INT4/INT8 round trips, bits per element, the Hadamard rotation, the region lists."""

import torch

from kvstreams_sglang.kv4 import (
    Int4Tensor,
    dequantize_int4,
    dequantize_int8,
    hadamard,
    hadamard_matrix,
    quantize_int4,
    quantize_int8,
)
from kvstreams_sglang.kv4.regions import region_lists


def test_int4_round_trip_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(64, 4, 128) * torch.rand(64, 4, 1) * 10 + torch.randn(64, 4, 1)
    t = quantize_int4(x)
    err = (dequantize_int4(t) - x).abs()
    step = t.scale.float()[..., None]
    # Half a step, plus the fp16 rounding of scale and offset (relative 2^-11 of the range).
    fp16_slack = 2 ** -10 * (x.abs().amax(-1, keepdim=True) + 15 * step)
    assert bool((err <= step / 2 + fp16_slack).all()), float((err - step / 2).max())


def test_int4_codes_are_nibbles_and_cost_4_25_bits():
    t = quantize_int4(torch.randn(10, 8, 128))
    codes = t.unpack_codes()
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15 and int(codes.min()) >= 0
    assert t.codes.shape == (10, 8, 64) and t.scale.dtype == torch.float16 and t.offset.dtype == torch.float16
    assert t.bits_per_element == 4.25


def test_int4_split_half_packing_puts_element_j_and_j_plus_64_in_one_byte():
    x = torch.arange(128, dtype=torch.float32).repeat(1, 1) % 16  # codes equal the values
    t = quantize_int4(x)
    assert int(t.codes[0, 3]) == (3 | (((64 + 3) % 16) << 4))
    assert torch.equal(t.unpack_codes()[0].float(), x[0])


def test_constant_vector_quantizes_exactly():
    x = torch.full((3, 128), 2.5)
    assert torch.equal(dequantize_int4(quantize_int4(x)), x)
    assert torch.allclose(dequantize_int8(quantize_int8(x)), x, rtol=2 ** -10)  # fp16 scale rounding


def test_int8_round_trip_error_is_at_most_half_a_step():
    torch.manual_seed(1)
    x = torch.randn(32, 4, 128) * 3
    t = quantize_int8(x)
    step = t.scale.float()[..., None]
    assert int(t.codes.abs().max()) <= 127
    assert bool(((dequantize_int8(t) - x).abs() <= step / 2 + 2 ** -10 * step * 127).all())
    assert t.bits_per_element == 8 + 16 / 128


def test_hadamard_is_orthonormal_and_symmetric():
    for n in (2, 16, 128):
        h = hadamard_matrix(n, dtype=torch.float64)
        assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
        assert torch.equal(h, h.T)
        x = torch.randn(5, n, dtype=torch.float64)
        assert torch.allclose(hadamard(x), x @ h, atol=1e-12)


def test_rotated_scores_equal_original_scores():
    torch.manual_seed(2)
    q, k = torch.randn(8, 128), torch.randn(300, 128) * 4
    assert torch.allclose(hadamard(q) @ hadamard(k).T, q @ k.T, atol=1e-5 * 128, rtol=1e-5)
    rel = (hadamard(q) @ hadamard(k).T - q @ k.T).norm() / (q @ k.T).norm()
    assert rel < 1e-5


def test_hadamard_rejects_non_power_of_two():
    import pytest

    with pytest.raises(ValueError, match="power of two"):
        hadamard(torch.randn(3, 96))


def test_int4_tensor_shape_reports_unpacked_dimension():
    t = quantize_int4(torch.randn(2, 3, 128))
    assert isinstance(t, Int4Tensor) and t.shape == (2, 3, 128)


def test_region_lists_with_a_host_bound_equal_the_synced_lists():
    """``capacity`` (CUDA-graph planning: no host sync) gives the same CSR lists, padded to the bound."""
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([1, 4, 2])
    slots = torch.randint(1, 1000, (3, 50), generator=g)
    positions = torch.sort(torch.randint(0, 300, (3, 50), generator=g), dim=1).values
    valid = torch.arange(50)[None] < torch.tensor([[50], [3], [31]])
    end = positions.max(1).values + 1
    synced = region_lists(rows, slots, positions, valid, end, sink=4, recent=16)
    bound = region_lists(rows, slots, positions, valid, end, sink=4, recent=16, capacity=int(valid.sum()))
    assert bound["kv_indices"].numel() == int(valid.sum()) and bound["side_indices"].numel() == 3 * (4 + 16)
    for name in ("kv", "side"):
        indptr = synced[f"{name}_indptr"]
        assert torch.equal(bound[f"{name}_indptr"], indptr)
        assert torch.equal(bound[f"{name}_indices"][: int(indptr[-1])], synced[f"{name}_indices"])

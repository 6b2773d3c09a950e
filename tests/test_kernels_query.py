"""The query-preparation kernel rotates and INT8-quantises like the torch reference."""

import pytest
import torch
from kv4_cases import rel_l2

from kvstreams_sglang.kernels import kv4_quantize_query
from kvstreams_sglang.kv4 import dequantize_int8
from kvstreams_sglang.kv4.reference import quantize_query


@pytest.mark.parametrize("shape,rotate", [((1, 1, 128), True), ((3, 8, 128), True), ((5, 4, 128), False)])
def test_query_kernel_matches_reference(shape, rotate, device):
    q = torch.randn(shape, device=device) * 3
    ours, ref = kv4_quantize_query(q, rotate=rotate), quantize_query(q, rotate=rotate)
    assert ours.codes.shape == shape and ours.scale.shape == shape[:-1]
    assert (ours.codes != ref.codes).float().mean() < 0.01  # rotation rounding may flip a rare code
    assert rel_l2(dequantize_int8(ours), dequantize_int8(ref)) <= 1e-3


@pytest.mark.parametrize("shape", [(6, 4, 128), (2, 3, 2, 128)])
def test_query_kernel_reads_a_slice_of_a_fused_projection_in_place(shape, device):
    """SGLang's q is a column slice of one q|k|v projection (token stride > heads x D): read without a copy, the
    same codes as from a contiguous copy; other ranks are flattened."""
    tokens, d = shape[0], shape[-1]
    inner = torch.Size(shape[1:-1]).numel()
    qkv = torch.randn(tokens, (inner + 2) * d, device=device) * 3
    q = qkv[:, : inner * d].view(shape)
    assert not q.is_contiguous()
    ours, ref = kv4_quantize_query(q), kv4_quantize_query(q.contiguous())
    assert torch.equal(ours.codes, ref.codes) and torch.equal(ours.scale, ref.scale)
    assert ours.codes.shape == shape

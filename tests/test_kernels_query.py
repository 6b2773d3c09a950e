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

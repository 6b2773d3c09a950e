"""The store kernel writes the same INT4/INT8 entries as the torch reference."""

import pytest
import torch
from kv4_cases import rel_l2

from kvstreams_sglang.kernels import kv4_store
from kvstreams_sglang.kv4 import KV4LayerCache, dequantize_int4, dequantize_int8
from kvstreams_sglang.kv4.reference import store_reference


@pytest.mark.parametrize("n,hkv,rotate", [(1, 1, True), (21, 2, True), (40, 4, False)])
def test_store_kernel_matches_reference_at_shuffled_slots(n, hkv, rotate, device):
    torch.manual_seed(n)
    d, num_slots = 128, 64
    k, v = torch.randn(n, hkv, d, device=device) * 3, torch.randn(n, hkv, d, device=device)
    slots = torch.randperm(num_slots, device=device)[:n]
    side = torch.where(torch.rand(n) < 0.5, torch.randperm(n), torch.full((n,), -1)).to(device)
    ours, ref = (KV4LayerCache.empty(num_slots, n, hkv, d, device=device) for _ in range(2))
    kv4_store(ours, k, v, slots, side, rotate=rotate)
    store_reference(ref, k, v, slots, side, rotate=rotate)

    # Rotation in the kernel and in torch may round differently, flipping a rare code.
    flipped = (ours.int4_k(slots).unpack_codes() != ref.int4_k(slots).unpack_codes()).float().mean()
    assert flipped < 0.01
    assert torch.equal(ours.v_codes[slots], ref.v_codes[slots])
    for a, b in ((ours.int4_k(slots), ref.int4_k(slots)), (ours.int4_v(slots), ref.int4_v(slots))):
        assert rel_l2(dequantize_int4(a), dequantize_int4(b)) <= 1e-3
    used = side[side >= 0]
    assert rel_l2(dequantize_int8(ours.int8_k(used)), dequantize_int8(ref.int8_k(used))) <= 1e-3
    assert torch.equal(ours.v_side[used], ref.v_side[used])
    # Untouched slots stay untouched.
    free = torch.ones(num_slots, dtype=torch.bool, device=device)
    free[slots] = False
    assert int(ours.k_codes[free].abs().sum()) == 0 and int(ours.k_meta[free].abs().sum()) == 0


def test_store_kernel_rejects_mismatched_shapes():
    cache = KV4LayerCache.empty(8, 8, 2, 128)
    with pytest.raises(ValueError, match="do not match"):
        kv4_store(cache, torch.randn(2, 3, 128), torch.randn(2, 3, 128), torch.arange(2))

"""The store kernel writes the same INT4/INT8 entries as the torch reference."""

import pytest
import torch
from kv4_cases import rel_l2

from kvstreams_sglang.kernels import kv4_store
from kvstreams_sglang.kv4 import KV4LayerCache, dequantize_int4, dequantize_int8
from kvstreams_sglang.kv4.reference import store_reference

# On a GPU "auto" takes the CUDA kernel (store_cuda.cu): the Triton kernel is then tested by "triton".
BACKENDS = ["auto", "triton"] if torch.cuda.is_available() else ["auto"]
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA store kernel needs a GPU")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,hkv,rotate", [(1, 1, True), (21, 2, True), (40, 4, False)])
def test_store_kernel_matches_reference_at_shuffled_slots(n, hkv, rotate, backend, device):
    torch.manual_seed(n)
    d, num_slots = 128, 64
    k, v = torch.randn(n, hkv, d, device=device) * 3, torch.randn(n, hkv, d, device=device)
    slots = torch.randperm(num_slots, device=device)[:n]
    side = torch.where(torch.rand(n) < 0.5, torch.randperm(n), torch.full((n,), -1)).to(device)
    ours, ref = (KV4LayerCache.empty(num_slots, n, hkv, d, device=device) for _ in range(2))
    kv4_store(ours, k, v, slots, side, rotate=rotate, backend=backend)
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


def _poisoned(num_slots, num_side, hkv, device):
    """A cache whose every byte holds a pattern (codes 0x5A, fp16 meta and scales -3.0), so an entry the kernel
    fails to write, or writes where it should not, shows."""
    c = KV4LayerCache.empty(num_slots, num_side, hkv, 128, device=device)
    for t in (c.k_codes, c.v_codes, c.k_side, c.v_side):
        t.view(torch.uint8).fill_(0x5A)
    for t in (c.k_meta, c.v_meta, c.k_side_scale, c.v_side_scale):
        t.fill_(-3.0)
    return c


@cuda_only
@pytest.mark.parametrize("n,hkv,dtype,rotate,layout", [
    (1, 1, torch.float32, True, "contiguous"),
    (21, 2, torch.float32, True, "contiguous"),
    (40, 4, torch.float32, False, "int32 ids"),
    (333, 8, torch.bfloat16, True, "qkv view"),  # K and V as views of one [N, 3 Hkv, D] buffer (odd N)
    (257, 4, torch.float16, True, "int32 ids"),
    (1001, 8, torch.bfloat16, False, "contiguous"),
    (7, 3, torch.bfloat16, True, "contiguous"),  # 21 vectors: a partial warp of 16
])
def test_store_cuda_kernel_matches_reference(n, hkv, dtype, rotate, layout):
    """The CUDA kernel against the torch reference: V codes, V meta and INT8 V side copies bit-exact; rotated
    K within the existing tolerances; nothing written outside the given slots and side slots."""
    from kvstreams_sglang.kernels import store_cuda

    device = torch.device("cuda")
    torch.manual_seed(1000 + n)
    d, num_slots = 128, 2 * n + 5
    if layout == "qkv view":
        qkv = torch.randn(n, 3 * hkv, d, device=device).to(dtype) * 2
        k, v = qkv[:, hkv:2 * hkv], qkv[:, 2 * hkv:]
    else:
        k = (torch.randn(n, hkv, d, device=device) * 3).to(dtype)
        v = (torch.randn(n, hkv, d, device=device) * torch.rand(n, hkv, 1, device=device)).to(dtype)
    v[0, 0] = 0.5  # a constant vector: scale 1, codes 0
    slots = torch.randperm(num_slots, device=device)[:n]
    side = torch.where(torch.rand(n, device=device) < 0.3, torch.randperm(n, device=device), -1)
    if layout == "int32 ids":
        slots, side = slots.int(), side.int()
    ours, ref = _poisoned(num_slots, n, hkv, device), _poisoned(num_slots, n, hkv, device)
    assert store_cuda.supported(ours, k, v, slots, side)
    kv4_store(ours, k, v, slots, side, rotate=rotate, backend="cuda")
    torch.cuda.synchronize()
    store_reference(ref, k, v, slots.long(), side.long(), rotate=rotate)

    s = slots.long()
    flipped = (ours.int4_k(s).unpack_codes() != ref.int4_k(s).unpack_codes()).float().mean()
    assert flipped < (0.01 if rotate else 1e-12), flipped
    assert rel_l2(dequantize_int4(ours.int4_k(s)), dequantize_int4(ref.int4_k(s))) <= 1e-3
    assert torch.equal(ours.v_codes, ref.v_codes)
    assert torch.equal(ours.v_meta, ref.v_meta)
    assert torch.equal(ours.v_side, ref.v_side) and torch.equal(ours.v_side_scale, ref.v_side_scale)
    used = side[side >= 0].long()
    assert rel_l2(dequantize_int8(ours.int8_k(used)), dequantize_int8(ref.int8_k(used))) <= 1e-3
    if not rotate:
        assert torch.equal(ours.k_codes, ref.k_codes) and torch.equal(ours.k_meta, ref.k_meta)
        assert torch.equal(ours.k_side, ref.k_side)
    # Untouched slots and side slots keep the poison.
    free = torch.ones(num_slots, dtype=torch.bool, device=device)
    free[s] = False
    assert torch.equal(ours.k_codes[free], ref.k_codes[free]) and torch.equal(ours.k_meta[free], ref.k_meta[free])
    free8 = torch.ones(n, dtype=torch.bool, device=device)
    free8[used] = False
    assert torch.equal(ours.k_side[free8], ref.k_side[free8])
    assert torch.equal(ours.k_side_scale[free8], ref.k_side_scale[free8])


@cuda_only
def test_store_cuda_kernel_exact_v_codes_at_scale():
    """Many vectors (bf16, as from the model): every V code and meta word bit-exact, K code flips rare."""
    device = torch.device("cuda")
    torch.manual_seed(7)
    n, hkv, num_slots = 20011, 8, 30000
    k = (torch.randn(n, hkv, 128, device=device) * torch.rand(n, hkv, 1, device=device) * 4).bfloat16()
    v = (torch.randn(n, hkv, 128, device=device) * torch.rand(n, hkv, 1, device=device) * 4).bfloat16()
    slots = torch.randperm(num_slots, device=device)[:n]
    ours, ref = _poisoned(num_slots, 8, hkv, device), _poisoned(num_slots, 8, hkv, device)
    kv4_store(ours, k, v, slots, backend="cuda")
    store_reference(ref, k, v, slots)
    assert torch.equal(ours.v_codes, ref.v_codes) and torch.equal(ours.v_meta, ref.v_meta)
    flipped = (ours.int4_k(slots).unpack_codes() != ref.int4_k(slots).unpack_codes()).float().mean()
    assert flipped < 1e-3, flipped
    assert rel_l2(dequantize_int4(ours.int4_k(slots)), dequantize_int4(ref.int4_k(slots))) <= 1e-3

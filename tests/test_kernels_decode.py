"""The decode kernel equals the torch reference on the same cache."""

import pytest
import torch
from kv4_cases import filled_cache, rel_l2

from kvstreams_sglang.kernels import kv4_decode, plan_decode
from kvstreams_sglang.kv4.reference import decode_reference


@pytest.mark.parametrize(
    "lengths,hq,hkv,splits",
    [
        ([1], 4, 2, None),  # L = 1: a single sink position, empty INT4 region
        ([100], 8, 2, 3),  # L < sink + recent: everything in INT8
        ([300, 17, 200], 8, 2, 4),  # mixed lengths, GQA 4, several splits
        ([230], 6, 3, 2),  # GQA with a non-power-of-two group... of 2, odd head count
        ([180, 181], 4, 4, 1),  # MHA
    ],
)
def test_decode_kernel_matches_reference(lengths, hq, hkv, splits, device):
    cache, meta, _ = filled_cache(lengths, hkv=hkv, seed=len(lengths) + hq, device=device)
    q = torch.randn(len(lengths), hq, 128, device=device)
    plan = plan_decode(**meta, num_kv_heads=hkv, num_splits=splits, block_n=32)
    out, lse = kv4_decode(q, cache, plan, return_lse=True)
    ref_out, ref_lse = decode_reference(q, cache, **meta)
    assert rel_l2(out, ref_out) <= 1e-3
    assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_decode_kernel_without_rotation_matches_reference(device):
    cache, meta, _ = filled_cache([260], hkv=2, rotate=False, device=device)
    q = torch.randn(1, 4, 128, device=device)
    plan = plan_decode(**meta, num_kv_heads=2, num_splits=2, block_n=32)
    assert rel_l2(kv4_decode(q, cache, plan, rotate=False), decode_reference(q, cache, **meta, rotate=False)[0]) <= 1e-3


@pytest.mark.parametrize("block_h,prefetch,stages", [(4, False, 3), (4, True, 1), (16, False, 2)])
def test_decode_kernel_launch_variants_match_reference(block_h, prefetch, stages, device):
    """Every launch variant the plan can pick (rows per program, prefetch or Triton pipelining)."""
    import dataclasses

    cache, meta, _ = filled_cache([300, 17, 200], hkv=2, seed=11, device=device)
    q = torch.randn(3, 8, 128, device=device)
    plan = plan_decode(**meta, num_kv_heads=2, num_splits=2, block_n=32, prefetch=prefetch, num_stages=stages)
    out, lse = kv4_decode(q, cache, dataclasses.replace(plan, block_h=block_h), return_lse=True)
    ref_out, ref_lse = decode_reference(q, cache, **meta)
    assert rel_l2(out, ref_out) <= 1e-3
    assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)


def test_decode_kernel_plan_reuse_across_layers(device):
    """One plan serves every layer of a step: its cached per-layer arguments and shared workspaces must not
    mix two caches up, and a repeated call gives the same output."""
    import dataclasses

    cache_a, meta, _ = filled_cache([300, 17, 200], hkv=2, seed=12, device=device)
    cache_b = dataclasses.replace(cache_a, k_codes=cache_a.k_codes ^ 0x35, v_codes=cache_a.v_codes ^ 0x5A,
                                  k_side=-cache_a.k_side)  # same slots, other contents (another layer)
    q = torch.randn(3, 8, 128, device=device)
    plan = plan_decode(**meta, num_kv_heads=2, num_splits=3, block_n=32)
    for _ in range(2):
        for cache in (cache_a, cache_b):
            out, lse = kv4_decode(q, cache, plan, return_lse=True)
            ref_out, ref_lse = decode_reference(q, cache, **meta)
            assert rel_l2(out, ref_out) <= 1e-3
            assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)
            assert rel_l2(kv4_decode(q, cache, plan), ref_out) <= 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA INT4 kernel runs on a GPU only")
@pytest.mark.parametrize(
    "lengths,hkv,splits,dtype,variant",
    [
        ([300, 17, 1000, 2500], 8, None, torch.float32, {}),  # tails, an all-INT8 request, several splits
        ([300, 17, 1000, 2500], 8, 3, torch.bfloat16, {}),  # a non-power-of-two split count, bf16 in and out
        ([5000], 8, 1, torch.float16, {}),  # one long split (online softmax over 150 tiles)
        ([300, 17, 200], 2, 2, torch.float32, {}),  # 2 KV heads (2 warps per CTA)
        ([17, 100], 8, None, torch.float32, {}),  # empty INT4 region everywhere
        ([300, 17, 1000, 2500], 8, 3, torch.float32, dict(cuda_warps=8, cuda_min_blocks=2)),  # 8 warps per CTA
        ([300, 17, 1000, 2500], 8, 3, torch.float32, dict(cuda_pipe=3, cuda_warps=4, cuda_min_blocks=4)),  # cp.async
        ([300, 17, 1000, 5000], 8, 3, torch.bfloat16,
         dict(cuda_tma=1, cuda_pipe=3, cuda_warps=8, cuda_min_blocks=2)),  # bulk-copy ring
        ([300, 17, 1000, 5000], 8, None, torch.float32, dict(cuda_tma=1, cuda_pipe=2, cuda_warps=4, cuda_min_blocks=4)),
    ],
)
def test_decode_cuda_int4_kernel_matches_reference(lengths, hkv, splits, dtype, variant):
    """The CUDA INT4 kernel (decode_cuda.py; each launch variant) + the Triton side/merge launch equal the torch
    reference."""
    import dataclasses

    from kvstreams_sglang.kernels import decode_cuda

    device = torch.device("cuda")
    cache, meta, _ = filled_cache(lengths, hkv=hkv, seed=len(lengths) + hkv, device=device)
    q = torch.randn(len(lengths), 4 * hkv, 128, device=device).to(dtype)
    plan = dataclasses.replace(plan_decode(**meta, num_kv_heads=hkv, cuda_int4=1, cuda_splits=splits), **variant)
    assert decode_cuda.kernel(hkv, dtype, device, plan.cuda_min_blocks, plan.cuda_warps, plan.cuda_pipe,
                              plan.cuda_tma) is not None, decode_cuda._STATE.get("errors")
    ref_out, ref_lse = decode_reference(q.float(), cache, **meta)
    for _ in range(2):  # the second call takes the cached launch paths
        out, lse = kv4_decode(q, cache, plan, return_lse=True)
        assert rel_l2(out.float(), ref_out) <= (1e-3 if dtype == torch.float32 else 1e-2)
        assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)

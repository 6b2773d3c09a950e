"""The decode kernel equals the torch reference on the same cache."""

import pytest
import torch
from kv4_cases import filled_cache, rel_l2

from kvstreams_sglang.kernels import kv4_decode, plan_decode
from kvstreams_sglang.kernels.decode import cuda_options
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


def _cuda_order_codes(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA kernel's query rotation + INT8 quantisation (decode_cuda.cu), operation for operation in fp32:
    16-point butterflies within a lane's 16 elements, then 3 stages across 8 lanes, scale by 1/sqrt(128)."""
    x = q.float().reshape(-1, 8, 16).clone()
    for st in (1, 2, 4, 8):
        i = torch.arange(16, device=q.device)
        lo = i[(i & st) == 0]
        a, c = x[:, :, lo].clone(), x[:, :, lo + st].clone()
        x[:, :, lo], x[:, :, lo + st] = a + c, a - c
    for st in (1, 2, 4):
        s = torch.arange(8, device=q.device)
        lo = s[(s & st) == 0]
        a, c = x[:, lo].clone(), x[:, lo + st].clone()
        x[:, lo], x[:, lo + st] = a + c, a - c
    x = (x * torch.tensor(0.08838834764831845, dtype=torch.float32)).reshape(-1, 128)
    sq = (x.abs().amax(-1) / torch.tensor(127.0)).to(torch.float16).float()
    sq = torch.where(sq == 0, torch.ones_like(sq), sq)
    return torch.floor(x / sq[:, None] + 0.5).clamp(-127, 127), sq


def _tie_free_query(shape, dtype, device, seed: int) -> torch.Tensor:
    """A random query whose INT8 codes the reference (``quantize_query``) and the CUDA kernel's rotation order
    agree on: two float summation orders of the Hadamard rotation round a value within ~1e-7 of a code
    boundary differently, one code apart (one such flip moves the LSE of a 5000-slot request by ~1e-3, the
    test's tolerance); that is not what the test checks. Seeded, so each case sees the same query."""
    from kvstreams_sglang.kv4.reference import quantize_query

    g = torch.Generator().manual_seed(seed)
    for _ in range(20):
        q = torch.randn(*shape, generator=g).to(device).to(dtype)
        ref = quantize_query(q.float(), rotate=True)
        codes, sq = _cuda_order_codes(q)
        if torch.equal(ref.codes.reshape(-1, 128).float(), codes) and torch.equal(ref.scale.reshape(-1).float(), sq):
            return q
    return q


# The CUDA kernel's launch variants: (lengths, KV heads, splits, query dtype, DecodePlan field overrides). Run on the
# GPU below; every one is also compiled for sm_90 on any machine with NVRTC (tests/test_cuda_sources.py).
CUDA_VARIANTS = [
    ([300, 17, 1000, 2500], 8, None, torch.float32, {}),  # tails, an all-INT8 request, several splits
    ([300, 17, 1000, 2500], 8, 3, torch.bfloat16, {}),  # a non-power-of-two split count, bf16 in and out
    ([5000], 8, 1, torch.float16, {}),  # one long split (online softmax over 150 tiles)
    ([300, 17, 200], 2, 2, torch.float32, {}),  # 2 KV heads (2 warps per CTA)
    ([17, 100], 8, None, torch.float32, {}),  # empty INT4 region everywhere
    ([300, 17, 1000, 2500], 8, 3, torch.float32, dict(cuda_warps=8, cuda_min_blocks=2)),  # 8 warps per CTA
    ([300, 17, 1000, 2500], 8, 3, torch.float32, dict(cuda_pipe=3, cuda_warps=4, cuda_min_blocks=4)),  # cp.async
    ([300, 17, 1000, 5000], 8, 3, torch.bfloat16, dict(cuda_tma=1, cuda_pipe=3, cuda_warps=8, cuda_min_blocks=2)),
    ([300, 17, 1000, 5000], 8, None, torch.float32, dict(cuda_tma=1, cuda_pipe=2, cuda_warps=4, cuda_min_blocks=4)),
    ([300, 17, 1000, 2500], 8, 3, torch.bfloat16, dict(cuda_fuse=0, cuda_issue=0)),  # v5: + Triton side/merge
    ([300, 17, 1000, 2500], 8, 3, torch.float32, dict(cuda_fuse=1, cuda_issue=0)),  # fused, v5 producers
    ([300, 17, 1000, 2500], 8, 3, torch.float16, dict(cuda_fuse=0, cuda_issue=1)),  # unfused, v6 producers
    ([1, 150, 144, 145, 7000], 8, 2, torch.float32, {}),  # side region only, side region + 1 INT4 slot
    ([300, 17, 1000, 5000], 8, 3, torch.bfloat16, dict(cuda_early=1)),  # v7: ring filled at kernel start
    ([300, 17, 1000, 2500], 8, None, torch.float32, dict(cuda_early=1, cuda_merge=1)),  # + one-pass merge
    ([1, 150, 144, 145, 7000], 8, 2, torch.float32, dict(cuda_early=1, cuda_merge=1)),  # side only / 1 slot
    ([300, 17, 1000, 5000], 8, 3, torch.float16, dict(cuda_early=1, cuda_pipe=3)),  # 3 stages filled early
    ([5000, 3000, 40], 8, 11, torch.float32, dict(cuda_merge=1)),  # 11 parts: the merge's 4-part groups
    ([300, 17, 1000, 2500], 8, 3, torch.bfloat16, dict(cuda_side_ctas=1)),  # v7: a side-region CTA per request
    ([1, 150, 144, 145, 7000], 8, 2, torch.float32, dict(cuda_side_ctas=2, cuda_early=1)),  # 2, side only
    ([300, 17, 1000, 5000], 8, None, torch.float16, dict(cuda_side_ctas=1, cuda_early=1, cuda_merge=1)),
    ([300, 17, 1000, 2500], 8, 2, torch.bfloat16, dict(cuda_wgroups=2)),  # v8: 2 warps per KV head, own parts
    ([1, 150, 144, 145, 7000], 8, 2, torch.float32, dict(cuda_wgroups=2)),  # side only / 1 slot / odd tiles
    ([5000, 3000, 40], 8, 3, torch.float16, dict(cuda_wgroups=2, cuda_merge=1, cuda_pipe=3)),  # 3 stages of 64
    ([300, 17, 1000, 2500], 8, 2, torch.bfloat16, dict(cuda_wgroups=2, cuda_wside=1)),  # v8: side warps beside
    ([1, 150, 144, 145, 7000], 8, 3, torch.float32, dict(cuda_wgroups=2, cuda_wside=1)),  # side only, 1 slot
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA INT4 kernel runs on a GPU only")
@pytest.mark.parametrize("lengths,hkv,splits,dtype,variant", CUDA_VARIANTS)
def test_decode_cuda_int4_kernel_matches_reference(lengths, hkv, splits, dtype, variant):
    """The CUDA kernel (decode_cuda.py; each launch variant; fused with the side region and the merge, or followed
    by the Triton side/merge launch) equals the torch reference."""
    import dataclasses

    from kvstreams_sglang.kernels import decode_cuda

    device = torch.device("cuda")
    cache, meta, _ = filled_cache(lengths, hkv=hkv, seed=len(lengths) + hkv, device=device)
    q = _tie_free_query((len(lengths), 4 * hkv, 128), dtype, device, seed=len(lengths) * 100 + hkv)
    plan = dataclasses.replace(plan_decode(**meta, num_kv_heads=hkv, cuda_int4=1, cuda_splits=splits), **variant)
    fn = decode_cuda.kernel(hkv, dtype, device, **cuda_options(plan))
    assert fn is not None, decode_cuda._STATE.get("errors")
    assert fn[6] == plan.cuda_wgroups  # the variant asked for, not a fallback
    ref_out, ref_lse = decode_reference(q.float(), cache, **meta)
    tol = 1e-3 if dtype == torch.float32 else 1e-2
    for _ in range(2):  # the second call takes the cached launch paths (and reuses the merge's ticket counters)
        out, lse = kv4_decode(q, cache, plan, return_lse=True)
        assert rel_l2(out.float(), ref_out) <= tol
        assert torch.allclose(lse, ref_lse, atol=1e-4, rtol=1e-4)
        assert rel_l2(kv4_decode(q, cache, plan).float(), ref_out) <= tol  # scratch LSE


def test_plan_decode_cuda_split_rules():
    """The CUDA kernel's split count (v6 rule, v7 rule for long requests of small batches) and the auto choice of a
    side-region CTA per request (only where splits + 1 CTAs per request are all resident, 2 per SM)."""
    def plan(batch, length, **kw):
        n4 = length - 144
        indptr = torch.arange(batch + 1, dtype=torch.int32) * n4
        side = torch.arange(batch + 1, dtype=torch.int32) * 144
        return plan_decode(indptr, torch.zeros(batch * n4, dtype=torch.int32), side,
                           torch.zeros(batch * 144, dtype=torch.int32), num_kv_heads=8, **kw)

    for (batch, length), (v6, v7) in {(64, 2048): (2, 2), (64, 8192): (2, 2), (64, 16384): (2, 4), (64, 32768): (2, 4),
                                      (32, 32768): (4, 8), (32, 16384): (4, 4), (128, 16384): (2, 2),
                                      (32, 1024): (3, 3)}.items():
        assert plan(batch, length, cuda_rule=6).cuda_splits == v6, (batch, length)
        assert plan(batch, length, cuda_rule=7).cuda_splits == v7, (batch, length)
    assert plan(64, 16384).cuda_splits == 4  # v7 is the default
    for (batch, length), v8 in {(32, 16384): 8, (64, 8192): 4, (64, 4096): 2, (32, 8192): 4, (64, 16384): 4}.items():
        assert plan(batch, length, cuda_rule=8).cuda_splits == v8, (batch, length)
    assert plan(64, 2048, cuda_side=-1).cuda_side_ctas == 1 and plan(64, 2048).cuda_side_ctas == 0
    assert plan(128, 8192, cuda_side=-1).cuda_side_ctas == 0 and plan(32, 4096, cuda_side=-1).cuda_side_ctas == 1

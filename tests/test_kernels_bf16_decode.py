"""The full-precision paged decode kernel (the BF16 baseline) equals exact attention."""

import pytest
import torch
from kv4_cases import rel_l2

from kvstreams_sglang.kernels import TritonDecodeVariant, bf16_decode, plan_decode
from kvstreams_sglang.kv4.reference import full_precision_attention


@pytest.mark.parametrize("lengths,hq,hkv,splits", [([1], 4, 2, None), ([70, 300, 5], 8, 2, 3), ([129], 6, 3, 2)])
def test_bf16_decode_matches_reference_at_shuffled_slots(lengths, hq, hkv, splits, device):
    total = sum(lengths)
    k_pool, v_pool = torch.randn(total + 9, hkv, 128, device=device), torch.randn(total + 9, hkv, 128, device=device)
    perm = torch.randperm(total + 9, device=device)[:total]
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    empty = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    plan = plan_decode(indptr, perm.to(torch.int32), empty, empty[:0], num_kv_heads=hkv, num_splits=splits,
                       triton_variant=TritonDecodeVariant(block_n=32))
    q = torch.randn(len(lengths), hq, 128, device=device)
    out = bf16_decode(q, k_pool, v_pool, plan)
    for b in range(len(lengths)):
        slots = perm[int(indptr[b]):int(indptr[b + 1])]
        ref, _ = full_precision_attention(q[b:b + 1], k_pool[slots], v_pool[slots], 128 ** -0.5)
        assert rel_l2(out[b], ref[0]) <= 1e-3

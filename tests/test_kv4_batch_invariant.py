"""Batch-invariant KV4 attention: a request's decode and extend outputs are the same bits whatever it is batched with.

Why: a server batches a stream's turn with whatever else is running; the default plans size the splits of every
request from the batch (its size, its longest list, the grid), so the same stream rounds differently in another
batch, and INT4 storage turns those last bits into code steps. ``KV4DecodeWorkspace(invariant=True)`` and
``kv4_attention_step(invariant=True)`` (what ``--kv4rl-batch-invariant`` and ``Engine(batch_invariant=True)`` run)
fix the split count, size each request's splits from its own list and keep one extend tile. The Triton kernels run
here under the interpreter, as on the GPU; each output is also held to the float64 reference."""

import pytest
import torch
import triton
from kv4_cases import filled_cache, rel_l2, tie_free_query

from kvstreams_sglang.kernels import KV4DecodeWorkspace, TritonDecodeVariant
from kvstreams_sglang.kernels.attend import kv4_attention_step
from kvstreams_sglang.kernels.decode import INVARIANT_SPLITS, cuda_split_count
from kvstreams_sglang.kernels.extend import GRID_TILE, extend_splits
from kvstreams_sglang.kv4.reference import decode_reference, extend_reference

T32 = TritonDecodeVariant(block_n=32)
HKV, HQ = 2, 8
LENGTHS = [400, 900, 60]  # INT4 lists of 256, 756 and 0 slots


def rows(meta: dict, keep: list[int]) -> dict:
    """The CSR lists of some of the requests, in that order."""
    out = {}
    for region in ("kv", "side"):
        ptr, idx = meta[f"{region}_indptr"].long(), meta[f"{region}_indices"]
        parts = [idx[ptr[r]:ptr[r + 1]] for r in keep]
        out[f"{region}_indptr"] = torch.tensor([0, *torch.tensor([p.numel() for p in parts]).cumsum(0).tolist()],
                                               dtype=torch.int32, device=idx.device)
        out[f"{region}_indices"] = torch.cat(parts)
    return out


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_invariant_decode_gives_a_request_the_same_bits_in_any_batch(graph, device):
    cache, meta, _ = filled_cache(LENGTHS, hkv=HKV, seed=3, device=device)
    q = tie_free_query((len(LENGTHS), HQ, 128), seed=4, device=device).to(torch.bfloat16)
    ref, _ = decode_reference(q.double(), cache, **meta)
    outs, plans = {}, {}
    for invariant in (True, False):
        ws = KV4DecodeWorkspace(4, HQ, HKV, 128, max_context=1024 if graph else None, device=device, max_side=144,
                                triton_variant=T32, invariant=invariant)
        for batch in ([0], [0, 1, 2], [2, 1, 0]):
            bs = 1 if len(batch) == 1 else 4  # a graph batch padded to a captured size (1, 2, 4, ...)
            plan = ws.plan(**rows(meta, batch), **(dict(graph=True, batch_size=bs) if graph else {}))
            out = ws.run(torch.cat([q[batch], q[:bs - len(batch)]]) if graph else q[batch], cache)
            outs[invariant, tuple(batch)] = out[batch.index(0)]
            plans[invariant, tuple(batch)] = (plan.splits, plan.cuda_splits)
            assert rel_l2(out[: len(batch)].float(), ref[batch].float()) <= 1e-2  # bf16 output
    alone, batched, reversed_ = (outs[True, b] for b in ((0,), (0, 1, 2), (2, 1, 0)))
    assert torch.equal(alone, batched) and torch.equal(alone, reversed_)
    assert plans[True, (0,)] == plans[True, (0, 1, 2)]
    assert plans[True, (0,)][0].num == INVARIANT_SPLITS and plans[True, (0,)][0].chunk == 0
    # the default plans follow the batch: eager ones its longest list, graph ones the captured batch size (at
    # server context lengths: the CUDA kernel's 128 splits of a 64k row alone, 64 in a batch of 4)
    if not graph:
        assert plans[False, (0,)] != plans[False, (0, 1, 2)]
    assert cuda_split_count(1, 65536) != cuda_split_count(4, 65536)


def test_invariant_extend_gives_a_request_the_same_bits_in_any_batch(device):
    """An extend's new tokens of one request, alone and beside another request's (whose grid changes the default
    tile and split-K choice): the same bits with ``invariant``."""
    prefix, new = [400, 600], [24, 40]
    # the control below needs the default to choose differently: request 0 alone is split-K, beside request 1 the
    # grid fills the GPU and runs unsplit. Request 1 gets new tokens until it does (40 under the interpreter's 4
    # "SMs"; on an H100/H200, 132 SMs, ~1k: 33 query blocks of 32 tokens x 2 requests x 2 KV heads)
    programs = lambda tokens, b: triton.cdiv(tokens, GRID_TILE.block_r // (HQ // HKV)) * b * HKV  # noqa: E731
    while extend_splits(programs(new[1], 2), sum(new), HQ, 128, torch.device(device)) > 1:
        new[1] += 32
    assert extend_splits(programs(new[0], 1), new[0], HQ, 128, torch.device(device)) > 1
    # the new tokens are stored past every prefix slot (with ~1k new tokens on a GPU, "the last n slots" of a cache
    # sized for the prefixes alone began at a negative slot: the store wrote out of bounds, into the reference's
    # cache too -- the H100, 2026-12-06)
    cache0, meta, _ = filled_cache(prefix, hkv=HKV, seed=7, device=device, spare_slots=sum(new))
    g = torch.Generator().manual_seed(8)
    # the GPU runs bf16, as the server does (fp32 operands need twice the shared memory of the invariant tile: more
    # than an H100 has); the interpreter fp32, since its tl.dot mis-multiplies bf16 (``kernels.batch_invariant``)
    dtype, tol = (torch.bfloat16, 1e-2) if torch.device(device).type == "cuda" else (torch.float32, 1e-3)
    q, k, v = ((torch.randn(sum(new), h, 128, generator=g) * 0.5).to(device, dtype) for h in (HQ, HKV, HKV))
    start = [0, new[0]]

    def run(batch: list[int], invariant: bool) -> torch.Tensor:
        cache = type(cache0)(**{name: t.clone() for name, t in vars(cache0).items()})
        sel = torch.cat([torch.arange(start[r], start[r] + new[r]) for r in batch])
        qo = torch.tensor([0, *torch.tensor([new[r] for r in batch]).cumsum(0).tolist()], dtype=torch.int32,
                          device=device)
        n = sel.numel()
        none = torch.full((n,), -1, dtype=torch.long, device=device)  # store nowhere: only the attention matters
        spare = torch.arange(cache.k_codes.shape[0] - n, cache.k_codes.shape[0], device=device)
        assert int(spare[0]) >= sum(prefix) + 7  # no prefix slot among them
        out = kv4_attention_step(cache, q[sel], k[sel], v[sel], mode="extend", qo_indptr=qo, out_slots=spare,
                                 side_slots=none, kv4=rows(meta, batch), sm_scale=128 ** -0.5, use_triton=True,
                                 max_new_tokens=max(new[r] for r in batch), invariant=invariant)
        ref = extend_reference(q[sel].double(), k[sel].double(), v[sel].double(), qo, cache0, **rows(meta, batch))
        assert rel_l2(out.float(), ref.float()) <= tol  # bf16: the output's own rounding is ~2e-3
        return out[: new[batch[0]]] if batch[0] == 0 else out[new[batch[0]]:]

    assert torch.equal(run([0], True), run([0, 1], True))
    assert torch.equal(run([0], True), run([1, 0], True))
    assert not torch.equal(run([0], False), run([0, 1], False))  # alone, the default splits its prefix (split-K)

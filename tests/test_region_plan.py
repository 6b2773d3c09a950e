"""The two-kernel region planner equals ``regions.row_region_lists`` (the torch rule), read from the row table.

Why: the kv4rl backend plans every step's INT4 / INT8 lists on the host before the launch; the kernels do in two
launches what the torch form does in ~75 (``kernels.region_plan``). Rows here are compacted as streams leave them
(evicted positions missing, kept ones at their positions), requests of every length including empty ones (a
CUDA graph's padding), both ``end`` conventions (decode: after the new token; extend: the first new token)."""

import pytest
import torch
from triton_keys import record_launch_keys

from kvstreams_sglang.kernels.region_plan import planned_region_lists
from kvstreams_sglang.kv4.regions import row_region_lists


def table(lengths: list[int], *, width: int, seed: int, device):
    """A row table whose rows hold compacted streams: row r's first ``lengths[r]`` slots at ascending logical
    positions with random gaps (evictions), the slots a permutation of the pool."""
    g = torch.Generator().manual_seed(seed)
    rows = len(lengths) + 3  # spare rows, never asked
    pool = rows * width
    req_to_token = torch.randperm(pool, generator=g).to(torch.int32).reshape(rows, width)
    slot_positions = torch.full((pool,), -7, dtype=torch.int32)
    ends = []
    for r, n in enumerate(lengths):
        gaps = torch.randint(0, 3, (n,), generator=g) * (torch.rand(n, generator=g) < 0.3)
        pos = torch.cumsum(1 + gaps, 0) - 1
        slot_positions[req_to_token[r, :n].long()] = pos.to(torch.int32)
        ends.append(int(pos[-1]) + 1 + int(torch.randint(0, 3, (1,), generator=g)) if n else 0)
    order = torch.randperm(len(lengths), generator=g)  # requests in another order than their rows
    return (order.to(device), torch.tensor(lengths)[order].to(device), torch.tensor(ends)[order].to(device),
            req_to_token.to(device), slot_positions.to(device))


@pytest.mark.parametrize("sink,recent", [(16, 128), (4, 16), (0, 8), (4, 0), (0, 0)])
@pytest.mark.parametrize("capacity", [False, True, "out"], ids=["exact", "capacity", "out"])
def test_planned_lists_equal_the_torch_rule(sink, recent, capacity, device):
    """``out``: planned into static buffers of a larger batch (a CUDA graph's, stale entries in them), as the
    backend's captured decode planning does."""
    lengths = [0, 1, 5, 300, 17, 0, 700, 140, 145, 260]  # blocks of 256: one, two and three walks
    width = 720
    rows, lens, ends, req_to_token, slot_positions = table(lengths, width=width, seed=sink + 3 * recent,
                                                            device=device)
    cap = int(sum(lengths)) + 5 if capacity is True else None
    want = row_region_lists(rows.long(), lens, ends.long(), req_to_token, slot_positions, width=width, sink=sink,
                            recent=recent, capacity=cap)
    out = None
    if capacity == "out":
        b, big = len(lengths), 2 * len(lengths)
        buffers = [torch.full((n,), 99, dtype=torch.int32, device=device)
                   for n in (big + 1, big * width, big + 1, big * (sink + recent) + 1)]
        out = (buffers[0][:b + 1], buffers[1], buffers[2][:b + 1], buffers[3])
    got = planned_region_lists(rows, lens, ends, req_to_token, slot_positions, sink=sink, recent=recent,
                               capacity=cap, out=out)
    if out is not None:
        assert all(got[k] is o for k, o in zip(("kv_indptr", "kv_indices", "side_indptr", "side_indices"), out,
                                               strict=True))
        assert int(buffers[0][b + 1]) == 99  # nothing written past the batch's indptr
    for region in ("kv", "side"):
        ptr = want[f"{region}_indptr"]
        assert torch.equal(got[f"{region}_indptr"], ptr), region
        n = int(ptr[-1])
        if out is None:
            assert got[f"{region}_indices"].numel() == want[f"{region}_indices"].numel()
        assert got[f"{region}_indices"].numel() >= n
        assert torch.equal(got[f"{region}_indices"][:n], want[f"{region}_indices"][:n]), region
    assert int(want["kv_indptr"][-1]) > 0 and (not sink + recent or int(want["side_indptr"][-1]) > 0)


def test_no_request_plans_empty_lists(device):
    req_to_token = torch.zeros(2, 8, dtype=torch.int32, device=device)
    none = torch.zeros(0, dtype=torch.int64, device=device)
    got = planned_region_lists(none, none, none, req_to_token, torch.zeros(16, dtype=torch.int32, device=device),
                               sink=4, recent=8, capacity=0)
    assert got["kv_indptr"].tolist() == [0] and got["side_indices"].numel() == 0


def test_plan_cost_bench_compares_the_two_planners_on_the_same_rows(tmp_path, device):
    """``bench.plan_cost`` (the GPU's side-by-side timing) plans the same lists both ways (a smoke run here; on a
    GPU machine on the GPU, since Triton runs CPU tensors only under the interpreter)."""
    from bench.plan_cost import main

    out = main(["--device", str(device), "--batches", "3", "--lengths", "70,300", "--iters", "1", "--out",
                str(tmp_path / "p.json")])
    assert [r["same_lists"] for r in out["rows"]] == [True, True]
    assert (tmp_path / "p.json").exists()


def test_planning_compiles_one_variant_whatever_the_batch(device, monkeypatch):
    """The planner's launch keys (``triton_keys``) do not follow the batch: its size (1, 16, others) and the INT8
    indptr's place in the shared indptr buffer (16-byte aligned or not, by the batch size) give one key per kernel.
    The write kernel had specialised on that alignment: a fresh H100 compiled its second variant during a learning
    run's first RL steps."""
    from kvstreams_sglang.kernels import region_plan

    keys = record_launch_keys(monkeypatch, region_plan, {"_count_kernel": "count", "_write_kernel": "write"})
    for b in (1, 2, 3, 4, 5, 7, 16, 17):
        rows, lens, ends, req_to_token, slot_positions = table([3 + 5 * i for i in range(b)], width=96, seed=b,
                                                                device=device)
        planned_region_lists(rows, lens, ends, req_to_token, slot_positions, sink=16, recent=128,
                             capacity=4000)  # a host bound: the recorded count kernel writes no counts to read
    assert {name: len(k) for name, k in keys.items()} == {"count": 1, "write": 1}

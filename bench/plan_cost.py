"""Host and device time of planning a kv4rl step's region lists: the torch rule against the planner kernels.

Why: the backend plans every step's INT4 / INT8 lists on the host before its launch (``KV4RLAttnBackend
._region_lists``); the scheduler cannot hide what that costs past a step's length. Side by side, in one process:
``torch`` is ``regions.row_region_lists`` (gather the rows, then ``region_lists``: ~75 ops), ``kernel`` is
``kernels.region_plan`` (two launches and a cumsum), ``graph`` (CUDA) the kernels into static buffers captured
in a CUDA graph and replayed, as the backend's decode planning runs per batch size (``DecodePlanGraph``, which
captures the side slots and slot positions with them). Rows are compacted streams (evicted positions missing),
``capacity`` given as under CUDA graphs (no host sync). Host time: the call alone (launches queue); device time:
CUDA events around it.

    python -m bench.plan_cost --out bench/results/plan_cost_h200.json            (GPU)
    python -m bench.plan_cost --device cpu --batches 4 --lengths 300 --iters 3  (a smoke run under the interpreter)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def rows_table(batch: int, length: int, *, device, seed: int = 0):
    """``batch`` requests holding ``length`` slots each of a row table, at ascending positions with gaps."""
    g = torch.Generator().manual_seed(seed)
    width = length + 64
    rows_total = batch + 1
    req_to_token = torch.randperm(rows_total * width, generator=g).to(torch.int32).reshape(rows_total, width)
    slot_positions = torch.zeros(rows_total * width, dtype=torch.int32)
    ends = []
    for r in range(batch):
        pos = torch.cumsum(1 + (torch.rand(length, generator=g) < 0.2).long() * 3, 0) - 1
        slot_positions[req_to_token[r + 1, :length].long()] = pos.to(torch.int32)
        ends.append(int(pos[-1]) + 1)
    rows = torch.arange(1, batch + 1)
    return (rows.to(device), torch.full((batch,), length).to(device), torch.tensor(ends).to(device),
            req_to_token.to(device), slot_positions.to(device), width)


def plan_torch(rows, lengths, ends, req_to_token, slot_positions, width, *, sink, recent, capacity):
    from kvstreams_sglang.kv4.regions import row_region_lists

    return row_region_lists(rows, lengths, ends, req_to_token, slot_positions, width=width, sink=sink, recent=recent,
                            capacity=capacity)


def plan_kernel(rows, lengths, ends, req_to_token, slot_positions, width, *, sink, recent, capacity):
    from kvstreams_sglang.kernels.region_plan import planned_region_lists

    return planned_region_lists(rows, lengths, ends, req_to_token, slot_positions, sink=sink, recent=recent,
                                capacity=capacity)


def captured_kernel_plan(args, kw):
    """``plan_kernel`` into static buffers, captured in a CUDA graph: (a replay function, the lists it writes)."""
    from kvstreams_sglang.kernels.region_plan import planned_region_lists

    rows, lengths, ends, req_to_token, slot_positions, _ = args
    b, dev = rows.numel(), rows.device
    out = tuple(torch.zeros(n, dtype=torch.int32, device=dev)
                for n in (b + 1, kw["capacity"], b + 1, b * (kw["sink"] + kw["recent"])))

    def run():
        planned_region_lists(rows, lengths, ends, req_to_token, slot_positions, sink=kw["sink"], recent=kw["recent"],
                             out=out)

    run()  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    lists = dict(zip(("kv_indptr", "kv_indices", "side_indptr", "side_indices"), out, strict=True))
    return (lambda *_, **__: graph.replay()), lists


def same_lists(want: dict, got: dict) -> bool:
    return all(torch.equal(want[k], got[k]) for k in ("kv_indptr", "side_indptr")) and all(
        torch.equal(want[f"{r}_indices"][: int(want[f"{r}_indptr"][-1])],
                    got[f"{r}_indices"][: int(want[f"{r}_indptr"][-1])]) for r in ("kv", "side"))


def time_planner(fn, args, kw, iters: int, cuda: bool) -> dict:
    for _ in range(3):  # warm-up (Triton compiles on its first call)
        fn(*args, **kw)
    if cuda:
        torch.cuda.synchronize()
    host, device = [], []
    for _ in range(iters):
        if cuda:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn(*args, **kw)
        host.append(time.perf_counter() - t0)
        if cuda:
            stop.record()
            stop.synchronize()
            device.append(start.elapsed_time(stop) / 1000.0)
    out = dict(host_ms=1000 * statistics.median(host))
    if device:
        out["device_ms"] = 1000 * statistics.median(device)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.plan_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batches", default="16,53,128")
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--recent", type=int, default=128)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    rows_out = []
    for b in (int(x) for x in a.batches.split(",")):
        for n in (int(x) for x in a.lengths.split(",")):
            rows, lengths, ends, r2t, sp, width = rows_table(b, n, device=device)
            args, kw = (rows, lengths, ends, r2t, sp, width), dict(sink=a.sink, recent=a.recent, capacity=b * n)
            want = plan_torch(*args, **kw)
            same = same_lists(want, plan_kernel(*args, **kw))
            row = dict(batch=b, length=n, same_lists=same,
                       torch=time_planner(plan_torch, args, kw, a.iters, cuda),
                       kernel=time_planner(plan_kernel, args, kw, a.iters, cuda))
            row["host_speedup"] = row["torch"]["host_ms"] / row["kernel"]["host_ms"]
            if cuda:
                replay, lists = captured_kernel_plan(args, kw)
                row["graph"] = time_planner(replay, args, kw, a.iters, cuda)
                torch.cuda.synchronize()
                row["graph_same_lists"] = same_lists(want, lists)
                row["graph_host_speedup"] = row["torch"]["host_ms"] / row["graph"]["host_ms"]
            rows_out.append(row)
            print(f"B={b:>4} L={n:>5}: torch host {row['torch']['host_ms']:.3f} ms "
                  f"(device {row['torch'].get('device_ms', float('nan')):.3f}), kernel host "
                  f"{row['kernel']['host_ms']:.3f} ms (device {row['kernel'].get('device_ms', float('nan')):.3f}), "
                  + (f"graph host {row['graph']['host_ms']:.3f} ms, " if "graph" in row else "")
                  + f"same lists {same}", flush=True)
    result = dict(command="python -m bench.plan_cost " + " ".join(argv if argv is not None else []),
                  device=torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)",
                  torch=torch.__version__, rows=rows_out)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = a.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(a.out)
    return result


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])

"""``bench.trace_summary``: a real torch-profiler trace reduced to the numbers the rollout bench keeps."""

import gzip
import shutil

import torch

from bench.trace_summary import merged_busy, summarize, summarize_dir


def test_overlapping_kernels_count_once():
    assert merged_busy([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17
    assert merged_busy([]) == 0


def test_gpu_time_by_kernel_and_busy_share():
    events = [dict(ph="X", cat="kernel", name="gemm", ts=0, dur=40), dict(ph="X", cat="kernel", name="gemm", ts=60,
                                                                           dur=20),
              dict(ph="X", cat="kernel", name="attn", ts=30, dur=20),  # overlaps the first gemm by 10
              dict(ph="X", cat="cpu_op", name="aten::mm", ts=0, dur=100), dict(ph="i", name="marker", ts=5)]
    s = summarize(events)
    assert s["span_ms"] == 0.1 and s["gpu_busy_ms"] == 0.07 and s["gpu_busy_share"] == 0.7
    assert [(k["name"], k["calls"]) for k in s["gpu_kernels"]] == [("gemm", 2), ("attn", 1)]
    assert s["host"] == [dict(name="cpu_op: aten::mm", total_ms=0.1, calls=1)]


def test_a_real_profiler_trace(tmp_path):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        x = torch.randn(64, 64)
        for _ in range(3):
            x = x @ x
    trace = tmp_path / "run" / "host-0.trace.json"
    trace.parent.mkdir()
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:  # SGLang writes them gzipped
        shutil.copyfileobj(f, g)
    trace.unlink()
    (out,) = summarize_dir(tmp_path)
    assert out["file"] == "host-0.trace.json.gz" and out["gpu_kernels"] == [] and out["gpu_busy_ms"] == 0
    mm = next(r for r in out["host"] if r["name"] == "cpu_op: aten::mm")
    assert mm["calls"] == 3 and mm["total_ms"] > 0

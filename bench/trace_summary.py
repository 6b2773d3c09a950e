"""Where a server's steps spend their time: a torch-profiler trace (SGLang's ``/start_profile``) reduced to a few
numbers that fit in a results JSON.

A chrome trace of 30 steps of a 36-layer model is tens of MB; the device gives back a few small files. So the
trace is summarised where it was written: GPU kernel time by kernel name (top ``top``), the GPU's busy time and
the wall span of the trace (busy share: how host-bound the steps were), and the host's time in the Python
functions and torch ops that launch work (top ``top`` by total, nested calls counted in each caller).

    python -m bench.trace_summary TRACE.json.gz [--top 25]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def merged_busy(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals (overlapping kernels on several streams count once)."""
    busy, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    return busy


def summarize(events: list[dict], top: int = 25) -> dict:
    gpu = defaultdict(lambda: [0.0, 0])
    host = defaultdict(lambda: [0.0, 0])
    intervals, t_min, t_max = [], float("inf"), float("-inf")
    for ev in events:
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, name, ts, dur = ev.get("cat", ""), ev.get("name", "?"), float(ev["ts"]), float(ev["dur"])
        t_min, t_max = min(t_min, ts), max(t_max, ts + dur)
        if cat in GPU_CATEGORIES:
            gpu[name][0] += dur
            gpu[name][1] += 1
            intervals.append((ts, ts + dur))
        elif cat in HOST_CATEGORIES:
            host[f"{cat}: {name}"][0] += dur
            host[f"{cat}: {name}"][1] += 1
    span_us = max(t_max - t_min, 0.0)
    busy_us = merged_busy(intervals)

    def table(d):
        rows = sorted(d.items(), key=lambda kv: -kv[1][0])[:top]
        return [dict(name=k[:160], total_ms=round(v[0] / 1e3, 3), calls=v[1]) for k, v in rows]

    return dict(span_ms=round(span_us / 1e3, 3), gpu_busy_ms=round(busy_us / 1e3, 3),
                gpu_busy_share=round(busy_us / span_us, 4) if span_us else None,
                gpu_kernels=table(gpu), host=table(host))


def summarize_dir(directory: Path, top: int = 25) -> list[dict]:
    """One summary per trace file under ``directory`` (SGLang writes one per rank, or per stage)."""
    out = []
    for path in sorted(directory.rglob("*.trace.json*")):
        try:
            out.append(dict(file=path.name, **summarize(load_events(path), top)))
        except (OSError, ValueError, KeyError) as e:  # a cut or unreadable trace: say so, keep the rest
            out.append(dict(file=path.name, error=repr(e)))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", type=Path)
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    print(json.dumps(summarize(load_events(a.trace), a.top), indent=1))


if __name__ == "__main__":
    main()

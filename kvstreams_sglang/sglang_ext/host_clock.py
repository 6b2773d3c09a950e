"""Host time the scheduler spends in our hooks, per hook: calls and seconds.

Why: the GPU idles while the scheduler works on the host past a step's length (a rollout on an H100 left ours'
GPU ~20% idle, ~4.7 ms per step, against ~0.7 ms for stock SGLang), and a sampling profiler needs a tool on the
device and a share-of-window reading. These counters cost two ``perf_counter`` calls a hook and come back with
``/kvstreams/host_clock``, so a bench reads where the scheduler's time went over its window as
a difference of two snapshots (``bench.rollout_sglang``: ms per turn by hook).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict


class HostClock:
    def __init__(self):
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def add(self, name: str, seconds: float) -> None:
        self.calls[name] += 1
        self.seconds[name] += seconds

    def report(self) -> dict[str, dict]:
        """``{hook: {"calls", "seconds"}}`` since start (cumulative: a reader differences two reports)."""
        return {name: dict(calls=self.calls[name], seconds=self.seconds[name]) for name in sorted(self.calls)}


def timed(name: str):
    """Method decorator: the call's host time goes to ``self.host_clock`` under ``name`` (exceptions too)."""

    def wrap(method):
        @functools.wraps(method)
        def timed_method(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                self.host_clock.add(name, time.perf_counter() - t0)

        return timed_method

    return wrap


def clock_difference(before: dict | None, after: dict | None) -> dict[str, dict]:
    """Per hook, the calls and milliseconds between two ``report``s (a hook new in ``after`` counts from 0)."""
    if not after:
        return {}
    before = before or {}
    out = {}
    for name, b in after.items():
        a = before.get(name, dict(calls=0, seconds=0.0))
        calls, ms = b["calls"] - a["calls"], 1000.0 * (b["seconds"] - a["seconds"])
        if calls:
            out[name] = dict(calls=calls, ms=ms, ms_per_call=ms / calls)
    return out

"""Where the scheduler waits for the GPU: a diagnostic for idle time between steps.

Under overlap scheduling the scheduler prepares batch N+1 while batch N runs; any host sync in that
work (``.item()``, ``.tolist()`` of a CUDA tensor, a boolean index, a blocking host-to-device copy)
drains the GPU queue and the next step starts late. With ``KVSTREAMS_SYNC_REPORT=1`` in the server's
environment the scheduler's event loop runs under ``torch.cuda.set_sync_debug_mode("warn")`` and each
distinct call stack that syncs is logged once (``kvstreams sync #k``), then again when its count reaches
10, 100, 1000, ...: the sites by frequency, without a profiler. SGLang's own per-step wait for the
sampled tokens (an event sync) is not a flagged operation.
"""

from __future__ import annotations

import logging
import os
import traceback
import warnings
from collections import Counter

ENV = "KVSTREAMS_SYNC_REPORT"
_MESSAGE = "called a synchronizing CUDA operation"
logger = logging.getLogger(__name__)


class SyncReport:
    """Counts host syncs by call stack (the innermost ``depth`` frames outside this module and ``warnings``)."""

    def __init__(self, depth: int = 10):
        self.depth = depth
        self.counts: Counter = Counter()
        self.ids: dict[tuple, int] = {}

    def record(self, stack: list[traceback.FrameSummary]) -> None:
        frames = [f for f in stack if f.filename not in (__file__, warnings.__file__)][-self.depth:]
        key = tuple((f.filename, f.lineno) for f in frames)
        self.counts[key] += 1
        n = self.counts[key]
        if key not in self.ids:
            self.ids[key] = len(self.ids) + 1
            logger.warning("kvstreams sync #%d (first):\n%s", self.ids[key], "".join(traceback.format_list(frames)))
        elif n >= 10 and str(n).strip("0") == "1":  # 10, 100, 1000, ...
            f = frames[-1] if frames else None
            logger.warning("kvstreams sync #%d: %d times (%s:%s)", self.ids[key], n, f and f.filename, f and f.lineno)


def install_if_requested() -> SyncReport | None:
    """With ``KVSTREAMS_SYNC_REPORT=1``: the scheduler's event loops run under sync debug mode, reported here."""
    if os.environ.get(ENV, "0") in ("", "0"):
        return None
    import torch
    from sglang.srt.managers.scheduler import Scheduler

    report = SyncReport()
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if _MESSAGE in str(message):
            report.record(traceback.extract_stack())
        else:
            shown(message, category, filename, lineno, file, line)

    def under_sync_debug(loop):
        def run(self):
            warnings.filterwarnings("always", message=f".*{_MESSAGE}.*")
            warnings.showwarning = showwarning
            torch.cuda.set_sync_debug_mode("warn")
            return loop(self)

        return run

    for name in ("event_loop_normal", "event_loop_overlap"):
        setattr(Scheduler, name, under_sync_debug(getattr(Scheduler, name)))
    return report

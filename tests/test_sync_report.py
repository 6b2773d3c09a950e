"""The scheduler's host-sync report (``KVSTREAMS_SYNC_REPORT``): each distinct call stack is logged once, then at
10, 100, ... occurrences; the CUDA side (``torch.cuda.set_sync_debug_mode``) runs on the GPU only."""

import logging
import traceback

from kvstreams_sglang.sglang_ext.sync_report import SyncReport


def _site_a():
    return traceback.extract_stack()


def _site_b():
    return traceback.extract_stack()


def test_sites_are_counted_by_call_stack_and_logged_sparsely(caplog):
    report = SyncReport(depth=4)
    with caplog.at_level(logging.WARNING, logger="kvstreams_sglang.sglang_ext.sync_report"):
        for _ in range(100):
            report.record(_site_a())
        report.record(_site_b())
    assert sorted(report.counts.values()) == [1, 100]
    assert sorted(report.ids.values()) == [1, 2]
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split(":")[0] for m in messages] == ["kvstreams sync #1 (first)", "kvstreams sync #1",
                                                   "kvstreams sync #1", "kvstreams sync #2 (first)"]
    assert "_site_a" in messages[0] and "100 times" in messages[2]

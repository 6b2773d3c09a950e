"""``bench.pyspy``: py-spy's samples of a process, as shares of a window (the rollout bench's scheduler profiles)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from bench import pyspy

BUSY = textwrap.dedent("""
    import time
    def spin(sec):
        t = time.time()
        while time.time() - t < sec:
            sum(range(1000))
    def main():
        while True:
            spin(0.03)   # runs 3/4 of the time,
            time.sleep(0.01)  # blocked 1/4: not sampled
    main()
""")


def test_summary_keeps_the_busiest_thread_and_shares_of_the_window(tmp_path):
    raw = tmp_path / "1.txt"
    raw.write_text("thread (0x1): MainThread;main (a.py:3);step (a.py:9) 120\n"
                   "thread (0x1): MainThread;main (a.py:3);recv (zmq/socket.py:7) 30\n"
                   "thread (0x2): Thread-1;loop (b.py:1) 20\n")
    s = pyspy.summarize(raw, seconds=1.0, rate=200)
    assert s["thread"] == "thread (0x1): MainThread" and s["samples"] == 150 and s["expected"] == 200
    assert s["ran_share"] == 0.75
    assert s["function_share"] == {"a.py:main": 0.75, "a.py:step": 0.6, "socket.py:recv": 0.15}


@pytest.mark.skipif(pyspy.pyspy_binary() is None, reason="py-spy not installed (pip install -e .[dev])")
def test_a_recording_of_a_busy_process_says_how_much_of_the_window_it_ran(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", BUSY])
    try:
        time.sleep(0.5)
        recorders = pyspy.start([proc.pid, 2**22 + 7], seconds=3, out_dir=tmp_path)  # the second pid: no process
        errors = pyspy.finish(recorders)
    finally:
        proc.kill()
    assert len(errors) == 1 and "Error" in errors[0]  # the missing process, said in one line
    s = pyspy.summarize(tmp_path / f"{proc.pid}.txt", seconds=3)
    print(s)
    assert 0.5 < s["ran_share"] <= 1.0 and s["function_share"]["<string>:spin"] > 0.5
    assert s["function_share"]["<string>:spin"] <= s["function_share"]["<string>:main"] == s["ran_share"]

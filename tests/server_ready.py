"""Waiting for a test's SGLang server: ready once ``/get_model_info`` answers, failed (with its log) if it exits."""

import subprocess
import time
import urllib.request
from pathlib import Path


def wait_ready(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"SGLang server exited ({proc.returncode}):\n{log.read_text()[-8000:]}")
        try:
            with urllib.request.urlopen(url + "/get_model_info", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise AssertionError(f"SGLang server not ready after {timeout_s}s:\n{log.read_text()[-8000:]}")

"""Waiting for a test's SGLang server: ready once ``/get_model_info`` answers, failed (with its log) if it exits
or logs that its port was taken (SGLang's process then stays up without serving)."""

import subprocess
import time
import urllib.request
from pathlib import Path

from bench.sglang_servers import BIND_FAILED


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
            if BIND_FAILED in log.read_text(errors="replace"):
                raise AssertionError(f"SGLang server's port was taken:\n{log.read_text()[-2000:]}") from None
            time.sleep(1)
    raise AssertionError(f"SGLang server not ready after {timeout_s}s:\n{log.read_text()[-8000:]}")

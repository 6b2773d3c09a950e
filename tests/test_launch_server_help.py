"""``python -m kvstreams_sglang.launch_server --help`` without the CPU test shims: the flags (ours and SGLang's)
where SGLang imports (a GPU install), else one line saying how to install it, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_help_without_shims_prints_flags_or_one_install_line():
    env = {k: v for k, v in os.environ.items() if k not in ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = str(ROOT)  # the project only: no tests/sglang_cpu_shims
    proc = subprocess.run([sys.executable, "-m", "kvstreams_sglang.launch_server", "--help"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    if proc.returncode == 0:  # SGLang imports here
        for flag in ("--model-path", "--attention-backend", "--kv4rl", "--kv4rl-recent", "--enable-kv-streams"):
            assert flag in proc.stdout, flag
        return
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    line = lines[0]
    assert line.startswith("launch_server: SGLang does not import here (")
    assert 'pip install -e ".[sglang]"' in line and "make sglang-cpu" in line and "sglang_cpu_shims" in line

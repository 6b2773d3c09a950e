"""The bubblewrap jail every command of an episode (and every graded test run) executes in.

One host directory is mounted read-write at ``/testbed``; the system directories and the Python
installation are mounted read-only; the root is read-only; ``/tmp`` is a private size-capped
tmpfs that is discarded after each command. There is no network (a fresh network namespace
holds only loopback), no capabilities (root outside is not root inside), a private PID
namespace (killing the jail kills every process started in it), and rlimits on CPU time,
address space and file size. A wall-clock timeout kills the whole jail.

Nothing else of the host is visible: in particular not the task repositories, whose other
commits hold the fixes.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import BinaryIO

from pydantic import BaseModel, ConfigDict, Field

WORKDIR = "/testbed"  # where SWE-bench images keep the repository; the agent sees this path


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here."""


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(60.0, gt=0, description="default wall-clock limit of one command")
    memory_mb: int = Field(4096, ge=64, description="address-space limit of every process")
    file_size_mb: int = Field(512, ge=1, description="largest file a process may write")
    tmp_size_mb: int = Field(512, ge=1, description="size of the private /tmp")


@cache
def _readonly_system() -> tuple[str, ...]:
    """bwrap arguments exposing the OS and this Python installation, read-only."""
    args: list[str] = []
    for path in ("/usr", "/etc"):
        args += ["--ro-bind", path, path]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(path):  # merged-/usr systems
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)} | {sys.prefix}
    for path in sorted(prefixes):
        if not path.startswith(("/usr/", "/etc/")):
            args += ["--ro-bind", path, path]
    return tuple(args)


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


@cache
def _check_bwrap(bwrap: str) -> None:
    probe = subprocess.run([bwrap, *_readonly_system(), "--unshare-net", "--unshare-pid", "--cap-drop", "ALL",
                            "--dev", "/dev", "--proc", "/proc", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise SandboxUnavailable(f"bubblewrap is installed but cannot create a sandbox here (user or network "
                                 f"namespaces disabled?): {probe.stderr.strip()}")


@cache
def _sized_tmpfs(bwrap: str) -> bool:
    """Whether this bwrap takes ``--size`` (0.7+, and not when installed setuid)."""
    probe = subprocess.run([bwrap, "--size", "1048576", "--tmpfs", "/tmp", *_readonly_system(), "true"],
                           capture_output=True)
    return probe.returncode == 0


def require_bwrap(bwrap: str | None = None) -> str:
    """The bwrap binary, checked to work; a clear error when it is missing."""
    path = bwrap or bwrap_path()
    if not path or not shutil.which(path):
        raise SandboxUnavailable("bubblewrap (`bwrap`) is not installed; the SWE environment runs every command "
                                 "in it. Install it with `apt-get install -y bubblewrap`.")
    _check_bwrap(path)
    return path


class Sandbox:
    """Runs commands in a bubblewrap jail around one directory (``root``, seen as ``/testbed``)."""

    def __init__(self, root: str | Path, *, limits: Limits | None = None, env: dict[str, str] | None = None,
                 bwrap: str | None = None):
        self.root = Path(root).resolve()
        self.limits = limits or Limits()
        self.bwrap = require_bwrap(bwrap)
        self.env = {
            "PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin",
            "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "TERM": "dumb",
            "PAGER": "cat", "GIT_PAGER": "cat", "PYTHONDONTWRITEBYTECODE": "1",
            "GIT_AUTHOR_NAME": "agent", "GIT_AUTHOR_EMAIL": "agent@localhost",
            "GIT_COMMITTER_NAME": "agent", "GIT_COMMITTER_EMAIL": "agent@localhost",
            **(env or {}),
        }

    def command(self, argv: list[str], timeout: float) -> list[str]:
        lim = self.limits
        cpu_s = math.ceil(timeout) + 5  # the wall clock binds first; this stops a process that escaped it
        ulimits = f"ulimit -t {cpu_s} -v {lim.memory_mb * 1024} -f {lim.file_size_mb * 1024} && exec \"$@\""
        env_args = [a for k, v in sorted(self.env.items()) for a in ("--setenv", k, v)]
        # /tmp first: binds after it may lie below it (a venv in /tmp) and must not be hidden by it.
        return [self.bwrap, "--dev", "/dev", "--proc", "/proc",
                *(("--size", str(lim.tmp_size_mb << 20)) if _sized_tmpfs(self.bwrap) else ()), "--tmpfs", "/tmp",
                *_readonly_system(),
                "--bind", str(self.root), WORKDIR, "--remount-ro", "/", "--chdir", WORKDIR,
                "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "sandbox",
                "--cap-drop", "ALL", "--die-with-parent", "--new-session", "--clearenv", *env_args,
                "bash", "-c", ulimits, "jail", *argv]

    def exec(self, argv: list[str], *, stdin: bytes = b"", output: BinaryIO, timeout: float | None = None
             ) -> tuple[int | None, bool]:
        """Run ``argv`` in the jail, stdout and stderr to ``output``; returns (exit code, timed out)."""
        timeout = timeout or self.limits.timeout_s
        proc = subprocess.Popen(self.command(argv, timeout), stdin=subprocess.PIPE, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.communicate(stdin, timeout=timeout)
            return proc.returncode, False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap dies, and with it its PID namespace
            proc.wait()
            return None, True


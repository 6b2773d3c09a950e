"""The bubblewrap jail every command of an episode (and every graded test run) executes in.

One host directory is mounted read-write at ``/testbed``; the system directories and the Python
installation are mounted read-only; the root is read-only; ``/tmp`` is a private size-capped
tmpfs that is discarded after each command. There is no network (a fresh network namespace
holds only loopback), no capabilities, a private PID namespace (killing the jail kills every
process started in it), and rlimits on CPU time, address space, file size and process count.
A wall-clock timeout kills the whole jail.

Commands run as the host's ``nobody`` (uid and gid 65534) in a user namespace of their own:
not as root, which would own every root-owned file whatever its capabilities (``/etc/shadow``
is mode 0640, owner root), and with ``RLIMIT_NPROC`` counting this jail's processes only (the
kernel counts per user per user namespace). ``nobody`` owns ``/testbed``: as root, the tree is
handed over (chowned) before each command.

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
from typing import BinaryIO, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

WORKDIR = "/testbed"  # where SWE-bench images keep the repository; the agent sees this path
JAIL_UID = JAIL_GID = 65534  # nobody / nogroup: owns no file of the host


class SandboxUnavailable(RuntimeError):
    """bubblewrap is missing or cannot create namespaces here."""


class Limits(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout_s: float = Field(60.0, gt=0, description="default wall-clock limit of one command")
    memory_mb: int = Field(4096, ge=64, description="address-space limit of every process")
    file_size_mb: int = Field(512, ge=1, description="largest file a process may write")
    tmp_size_mb: int = Field(512, ge=1, description="size of the private /tmp")
    max_processes: int = Field(512, ge=8, description="processes and threads a command may have at once (a fork "
                                                      "bomb gets EAGAIN): RLIMIT_NPROC in the jail's user namespace")


@cache
def _readonly_system() -> tuple[str, ...]:
    """bwrap arguments exposing the OS and this Python installation, read-only.

    The directories above a bind (``/root/.pyenv/versions`` above a pyenv Python) are made
    with ``--dir``, mode 0755: left to bwrap, Debian's 0.8 makes them 0700 and root's, which
    nobody cannot cross."""
    args: list[str] = []
    made = {"/", "/tmp"}
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
            for parent in reversed(Path(path).parents):
                if str(parent) not in made:
                    args += ["--dir", str(parent)]
                    made.add(str(parent))
            args += ["--ro-bind", path, path]
            made.add(path)
    return tuple(args)


class JailUser(NamedTuple):
    """How a jailed command comes to run as nobody in a user namespace of its own."""

    bwrap_args: tuple[str, ...]  # bwrap options, after --cap-drop ALL
    prefix: tuple[str, ...]  # programs the command runs under, inside the jail


@cache
def jail_user() -> JailUser:
    if os.geteuid() != 0:
        # bwrap's own user namespace maps the caller to nobody inside; the caller is not root
        return JailUser(("--unshare-user", "--uid", str(JAIL_UID), "--gid", str(JAIL_GID)), ())
    # As root, bwrap's --unshare-user would map nobody inside to uid 0 outside: the jail would
    # still own every root-owned file. So bwrap mounts as root (it alone can reach a Python
    # under /root), then the command drops to the host's nobody (setpriv: no groups, no
    # capabilities) and enters a user namespace of its own (unshare) for RLIMIT_NPROC. No
    # bounding-set drop: bwrap sets no_new_privs, so with no capabilities left nothing the jail
    # execs can gain one (setuid bits and file capabilities are ignored), and a container whose
    # root may not change the bounding set (the H200 device's: "setpriv: apply bounding set:
    # Operation not permitted") would refuse the whole jail.
    return JailUser(("--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"),
                    ("setpriv", f"--reuid={JAIL_UID}", f"--regid={JAIL_GID}", "--clear-groups", "--inh-caps=-all",
                     "unshare", "--user", f"--map-user={JAIL_UID}", f"--map-group={JAIL_GID}", "--"))


def hand_over(tree: Path) -> None:
    """Make nobody own every entry of ``tree`` (run as root: files the host wrote are root's,
    hence read-only in the jail). Links are changed, never followed: the jail may have left
    symlinks pointing anywhere on the host."""
    entries = [str(tree)]
    for parent, dirs, files in os.walk(tree):
        entries += [os.path.join(parent, name) for name in dirs + files]
    for path in entries:
        st = os.lstat(path)
        if st.st_uid != JAIL_UID or st.st_gid != JAIL_GID:
            os.lchown(path, JAIL_UID, JAIL_GID)


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


@cache
def _check_bwrap(bwrap: str) -> None:
    user = jail_user()
    missing = [tool for tool in ("setpriv", "unshare") if tool in user.prefix and not shutil.which(tool)]
    if missing:
        raise SandboxUnavailable(f"running as root, the jail drops to nobody with util-linux's setpriv and unshare; "
                                 f"missing: {', '.join(missing)} (apt-get install -y util-linux)")
    probe = subprocess.run([bwrap, *_readonly_system(), "--unshare-net", "--unshare-pid", "--cap-drop", "ALL",
                            *user.bwrap_args, "--dev", "/dev", "--proc", "/proc", *user.prefix, "true"],
                           capture_output=True, text=True)
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
        user = jail_user()
        cpu_s = math.ceil(timeout) + 5  # the wall clock binds first; this stops a process that escaped it
        # cd here, as nobody: bwrap's --chdir runs before the drop, without the capabilities to
        # enter a tree nobody owns with mode 0700
        ulimits = (f"cd {WORKDIR} && ulimit -t {cpu_s} -v {lim.memory_mb * 1024} -f {lim.file_size_mb * 1024} "
                   f"-u {lim.max_processes} && exec \"$@\"")
        env_args = [a for k, v in sorted(self.env.items()) for a in ("--setenv", k, v)]
        # /tmp first: binds after it may lie below it (a venv in /tmp) and must not be hidden by it.
        return [self.bwrap, "--dev", "/dev", "--proc", "/proc",
                *(("--size", str(lim.tmp_size_mb << 20)) if _sized_tmpfs(self.bwrap) else ()),
                "--perms", "1777", "--tmpfs", "/tmp", *_readonly_system(),
                "--bind", str(self.root), WORKDIR, "--remount-ro", "/",
                "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--hostname", "sandbox",
                "--cap-drop", "ALL", *user.bwrap_args, "--die-with-parent", "--new-session", "--clearenv", *env_args,
                *user.prefix, "bash", "-c", ulimits, "jail", *argv]

    def exec(self, argv: list[str], *, stdin: bytes = b"", output: BinaryIO, timeout: float | None = None
             ) -> tuple[int | None, bool]:
        """Run ``argv`` in the jail, stdout and stderr to ``output``; returns (exit code, timed out)."""
        timeout = timeout or self.limits.timeout_s
        if os.geteuid() == 0:
            hand_over(self.root)
        proc = subprocess.Popen(self.command(argv, timeout), stdin=subprocess.PIPE, stdout=output,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.communicate(stdin, timeout=timeout)
            return proc.returncode, False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap dies, and with it its PID namespace
            proc.wait()
            return None, True


"""Where a server's Python time goes: py-spy samples of its scheduler (and of the bench's own client loop).

SGLang's torch profiler shows kernels and the ops that launch them, not the Python between steps: the scheduler's
request handling, the stream cache, the batch's planning, the client's turnaround. ``py-spy record --nonblocking``
samples each running thread's Python stack at a fixed rate without stopping the process; a thread that is blocked
(on a socket, a queue, a GPU sync, a sleep) is not sampled. So over a window of ``seconds`` at ``rate`` samples per
second, a thread's samples / (rate x seconds) is the share of the window it ran, and a function's samples over the
same is the share of the window it (inclusive) ran.

    procs = start([scheduler_pid(server.proc.pid), os.getpid()], seconds=10, out_dir=d)
    ...
    summary = summarize(d / f"{pid}.txt")

``summarize`` keeps the thread with the most samples (the scheduler's event loop; the client's asyncio loop): the
share of the window it ran, and per function (top ``top``) the share of the window it was on that thread's stack.
py-spy may fall behind its rate on a loaded host: ``samples`` and ``expected`` say how far. Needs the ``py-spy``
binary (on the device: carried as a wheel in ``.devtools``, ``bench/device/tools_bundle.sh``).
"""

from __future__ import annotations

import collections
import os
import shutil
import subprocess
import sys
from pathlib import Path


def pyspy_binary() -> str | None:
    """On PATH, beside this interpreter (a venv's bin), or in a ``pip install --target`` folder's bin on sys.path."""
    for where in (shutil.which("py-spy"), Path(sys.executable).parent / "py-spy",
                  *(Path(p) / "bin" / "py-spy" for p in sys.path if p)):
        if where and os.access(where, os.X_OK):
            return str(where)
    return None


def scheduler_pid(root_pid: int, title: str = "sglang::scheduler") -> int | None:
    """The descendant of ``root_pid`` whose command line starts with ``title`` (SGLang sets its processes' titles)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children[ppid].append(int(entry))
    todo = list(children.get(root_pid, []))
    while todo:
        pid = todo.pop()
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if cmd.startswith(title):
            return pid
        todo.extend(children.get(pid, []))
    return None


def start(pids: list[int], *, seconds: float, out_dir: Path, rate: int = 200) -> list[subprocess.Popen]:
    """One ``py-spy record`` per pid for ``seconds``, raw (collapsed) stacks into ``out_dir/<pid>.txt``."""
    exe = pyspy_binary()
    if exe is None:
        raise FileNotFoundError("py-spy is not on PATH (pip install py-spy; on the device carry .devtools)")
    out_dir.mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([exe, "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                              "--rate", str(rate), "--nonblocking", "--threads", "--format", "raw",
                              "--output", str(out_dir / f"{pid}.txt")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for pid in pids]


def finish(procs: list[subprocess.Popen], timeout_s: float = 60.0) -> list[str]:
    """Wait for the recorders; their error lines (a recorder that could not attach says why)."""
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode:
            lines = err.decode(errors="replace").strip().splitlines()
            first = lines[0] if lines else f"rc {p.returncode}"
            errors.append(next((x for x in lines if x.startswith("Error")), first))
    return errors


def _frame(f: str) -> str:
    """py-spy's ``function (path/file.py:line)`` -> ``file.py:function``."""
    name, _, where = f.partition(" (")
    return f"{where.split(':')[0].rsplit('/', 1)[-1]}:{name}" if where else name


def summarize(raw: Path, *, seconds: float, rate: int = 200, top: int = 30) -> dict:
    """The busiest thread of a ``start`` recording: the share of the window it ran, and per function the share of
    the window it was on that thread's stack."""
    threads: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        # --threads: a frame names the thread ('thread (0x...): name'); before it, with --subprocesses, the process
        head = next((i for i, f in enumerate(frames) if f.startswith("thread (")), None)
        thread = frames[head] if head is not None else "all"
        threads[thread].append(([_frame(f) for f in frames[head + 1 if head is not None else 0:]], int(count)))
    expected = round(rate * seconds)
    if not threads:
        return dict(samples=0, expected=expected, ran_share=0.0)
    thread, stacks = max(threads.items(), key=lambda kv: sum(c for _, c in kv[1]))
    total = sum(c for _, c in stacks)
    inclusive: collections.Counter = collections.Counter()
    for frames, count in stacks:
        for f in set(frames):
            inclusive[f] += count
    return dict(samples=total, expected=expected, thread=thread, ran_share=round(total / expected, 4),
                function_share={f: round(c / expected, 4) for f, c in inclusive.most_common(top)})

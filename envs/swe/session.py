"""A bash session in a jail: the working directory and exported variables persist between
commands, every command has a timeout, and its output is truncated in the middle.

Each command runs in a fresh shell (so a timeout can kill everything it started, background
jobs included); the shell's state is carried over instead: after the command, a wrapper prints
``export -p`` and ``cd $PWD`` behind a random marker line, and the next command's shell
evaluates them first. The agent sees the same thing as with a live shell, minus background
processes outliving their command.
"""

from __future__ import annotations

import os
import secrets
import shlex
import tempfile
import time
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from .sandbox import WORKDIR

_WRAPPER = r"""
IFS= read -r -d '' __kv_state
IFS= read -r -d '' __kv_marker
__kv_cmd=$(cat)
exec </dev/null
eval "$__kv_state" >/dev/null 2>&1
unset __kv_state
__kv_exit() {
    __kv_rc=$?
    printf '\n%s\n' "$__kv_marker"
    export -p
    printf 'cd -- %q\n' "$PWD"
    exit $__kv_rc
}
trap __kv_exit EXIT
eval "$__kv_cmd"
"""

_TAIL_SCAN = 1 << 20  # the state block is searched for in the last MiB of output


class Jail(Protocol):
    def exec(self, argv: list[str], *, stdin: bytes = b"", output: BinaryIO, timeout: float | None = None
             ) -> tuple[int | None, bool]: ...


@dataclass
class CommandResult:
    output: str  # stdout and stderr interleaved, as a terminal shows them
    exit_code: int | None  # None when killed at the timeout
    timed_out: bool
    elapsed_s: float
    omitted_chars: int = 0  # cut from the middle of the output

    def render(self, timeout_s: float) -> str:
        """The observation the agent reads."""
        out = self.output.rstrip("\n")
        if self.timed_out:
            status = f"[command timed out after {timeout_s:g}s and was killed]"
        else:
            status = f"[exit code: {self.exit_code}]"
        return f"{out}\n{status}" if out else status


def truncate_middle(text: str, limit: int) -> tuple[str, int]:
    if len(text) <= limit:
        return text, 0
    head, tail = limit // 2, limit - limit // 2
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[len(text) - tail:]}", omitted


class BashSession:
    def __init__(self, jail: Jail, *, timeout_s: float = 60.0, max_output_chars: int = 4000, workdir: str = WORKDIR):
        self.jail, self.timeout_s, self.max_output_chars = jail, timeout_s, max_output_chars
        self.state = f"cd -- {shlex.quote(workdir)}"

    def run(self, command: str, *, timeout: float | None = None, max_output_chars: int | None = -1) -> CommandResult:
        """``max_output_chars=None`` returns the whole output (for logs the harness parses)."""
        limit = self.max_output_chars if max_output_chars == -1 else max_output_chars
        marker = f"__kvstreams_state_{secrets.token_hex(16)}__"
        payload = f"{self.state}\0{marker}\0{command}".encode()
        start = time.monotonic()
        with tempfile.TemporaryFile() as out:
            exit_code, timed_out = self.jail.exec(["bash", "-c", _WRAPPER], stdin=payload, output=out,
                                                  timeout=timeout or self.timeout_s)
            elapsed = time.monotonic() - start
            end, state = _split_state(out, marker)
            text, omitted = _read_output(out, end, limit)
        if state is not None and not timed_out:
            self.state = state
        return CommandResult(text, exit_code, timed_out, elapsed, omitted)


def _split_state(out: BinaryIO, marker: str) -> tuple[int, str | None]:
    """(where the command's own output ends, the state block after the marker or None)."""
    size = out.seek(0, os.SEEK_END)
    tail_start = max(0, size - _TAIL_SCAN)
    out.seek(tail_start)
    tail = out.read()
    at = tail.rfind(f"\n{marker}\n".encode())
    if at < 0:
        return size, None
    return tail_start + at, tail[at + len(marker) + 2:].decode(errors="replace")


def _read_output(out: BinaryIO, end: int, limit: int | None) -> tuple[str, int]:
    """The first ``end`` bytes as text, middle-truncated to ``limit`` characters; reads only
    the head and tail of a huge output."""
    window = None if limit is None else 4 * limit + 64  # bytes enough for `limit` characters
    out.seek(0)
    if window is None or end <= 2 * window:
        text = out.read(end).decode(errors="replace")
        return truncate_middle(text, limit) if limit is not None else (text, 0)
    head = out.read(window).decode(errors="ignore")[: limit // 2]
    out.seek(end - window)
    tail = out.read(window).decode(errors="ignore")[-(limit - limit // 2):]
    omitted = end - len(head.encode()) - len(tail.encode())
    return f"{head}\n[... about {omitted} bytes omitted ...]\n{tail}", omitted

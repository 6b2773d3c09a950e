"""Problem statements for injected bugs, written from what a failing test shows and nothing more.

A statement names the failing test, shows its source (the reproduction a bug reporter would
paste) and pytest's failure report cut down to the frames in test files and the error lines:
frames inside the library would point at the mutated line, which is more than a user reporting
the bug would know. Object addresses are masked so that a rebuild writes the same text.
"""

from __future__ import annotations

import re

from .hidden_tests import source_of
from .pytest_log import failure_report

_FRAME = re.compile(r"^(\S+?\.py):(\d+): in (\S+)$")
MAX_ERROR_LINES = 20
MAX_LINE_CHARS = 300


def _clip(line: str) -> str:
    return line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + " ..."


def reported_failure(report: str, test_prefixes: tuple[str, ...]) -> str:
    """The report's frames in test files and its ``E`` lines; library frames become ``...``."""
    out: list[str] = []
    keep = True
    errors = 0
    for line in report.split("\n"):
        if m := _FRAME.match(line):
            keep = m.group(1).startswith(test_prefixes)
            if keep:
                out.append(line)
            elif out[-1:] != ["..."]:
                out.append("...")
        elif line.startswith("E "):
            errors += 1
            if errors <= MAX_ERROR_LINES:
                out.append(_clip(line))
        elif keep and line.strip():
            out.append(_clip(line))
    return re.sub(r"0x[0-9a-fA-F]{6,}", "0x...", "\n".join(out).strip())


def problem_statement(*, repo: str, version: str, failing: list[str], log: str, sources: dict[str, str],
                      test_prefixes: tuple[str, ...]) -> str:
    """``failing``: the FAIL_TO_PASS ids; ``sources``: test file path -> text (clean tree)."""
    first = failing[0]
    others = len(failing) - 1
    parts = [f"`{first}` fails on {repo} {version}" + (f" (and {others} other test{'s' * (others > 1)} fail too)"
                                                      if others else "") + "."]
    if (src := source_of(sources.get(first.split("::", 1)[0], ""), first)) is not None:
        parts.append(f"The test:\n\n```python\n{src}\n```")
    report = failure_report(log, first)
    if report:
        parts.append(f"What pytest reports:\n\n```\n{reported_failure(report, test_prefixes)}\n```")
    if others:
        shown = failing[1:6]
        parts.append("Other failing tests: " + ", ".join(f"`{t}`" for t in shown)
                     + (", ..." if others > len(shown) else "") + ".")
    parts.append("These tests should pass. Find the cause in the library and fix it.")
    return "\n\n".join(parts)

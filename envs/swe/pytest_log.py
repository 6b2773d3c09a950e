"""Reading a pytest ``-rA`` log: the status of every test, and the failure report of one.

``parse_statuses`` follows SWE-bench's ``parse_log_pytest`` (swebench/harness/log_parsers)
line for line, so a log grades the same here as in SWE-bench: each short-summary line that
starts with a status word maps the test id after it to that status.
"""

from __future__ import annotations

import re

PASSED, FAILED, SKIPPED, ERROR, XFAIL = "PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL"
STATUSES = (FAILED, PASSED, SKIPPED, ERROR, XFAIL)

_SECTION = re.compile(r"^={5,} (.+?) ={5,}$")
_BLOCK = re.compile(r"^_{3,} (.+?) _{3,}$")


def parse_statuses(log: str) -> dict[str, str]:
    statuses: dict[str, str] = {}
    for line in log.split("\n"):
        if any(line.startswith(s) for s in STATUSES):
            if line.startswith(FAILED):
                line = line.replace(" - ", " ")
            parts = line.split()
            if len(parts) <= 1:
                continue
            statuses[parts[1]] = parts[0]
    return statuses


def headline(test_id: str) -> str:
    """The title pytest gives a test's failure report: ``a.py::C::t[1]`` -> ``C.t[1]``."""
    return ".".join(test_id.split("::")[1:])


def failure_report(log: str, test_id: str) -> str | None:
    """The ``--tb`` report of one failed test (the block under its ``___ title ___`` line)."""
    title, lines, out, section = headline(test_id), log.split("\n"), None, ""
    for line in lines:
        if m := _SECTION.match(line):
            section = m.group(1)
            if out is not None:
                break
            continue
        if section not in ("FAILURES", "ERRORS"):
            continue
        if m := _BLOCK.match(line):
            if out is not None:
                break
            if m.group(1) in (title, f"ERROR at setup of {title}", f"ERROR at teardown of {title}"):
                out = []
            continue
        if out is not None:
            out.append(line)
    return "\n".join(out).strip("\n") if out is not None else None

"""Between the model's words and the game's: one command out of a message, a compact
observation out of the interpreter's screen text. Shared by TextWorld and ALFWorld
(ALFWorld is played by TextWorld's engine)."""

from __future__ import annotations

import re

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
# Interpreter chrome, not game text: the prompt line with its status bar ("> ... -= Kitchen =-3/7")
# and the restart menu after the end.
_CHROME = re.compile(r"^(>.*|Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last command\?)$")


MAX_COMMAND = 160


def parse_action(message: str) -> str:
    """The command in a model message: its first non-empty line after any ``<think>`` block,
    printable characters only, without a leading prompt sign, quotes or backticks. Games parse
    one command per turn, so anything after the first line would be lost (or misread) anyway.
    Only printable ASCII reaches the interpreter: the Z-machine reads ZSCII (a NUL crashes it:
    Jericho segfaults), and backslashes go because the interpreter reads ``\\`` as the start of one of its own escape
    commands (``\\help``, ``\\q``), not as game input. Jericho truncates at 198 bytes; we cut
    at ``MAX_COMMAND`` characters."""
    text = _THINK.sub("", message)
    for line in text.splitlines():
        line = "".join(c for c in line if " " <= c <= "~" and c != "\\")[:MAX_COMMAND]
        line = line.strip().lstrip(">").strip().strip("`'\"").strip()
        if line:
            return line
    return ""


def compact(text: str) -> str:
    """Game text without the interpreter's chrome, blank lines or trailing spaces."""
    lines = (line.strip() for line in text.splitlines())
    return "\n".join(line for line in lines if line and not _CHROME.match(line))

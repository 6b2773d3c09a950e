"""The text protocol the model acts through, and the system prompt that teaches it.

A message is free reasoning followed by exactly one action, starting at the beginning of a
line (SWE-agent's thought/action format, with OpenHands' tool names):

    bash: <command>                      everything after "bash:" to the end of the message
    str_replace_editor: {<JSON args>}    the OpenHands str_replace_editor tool's arguments
    submit                               end the episode; the changes are graded

A ``<think>...</think>`` block is ignored. A malformed action parses to ``Malformed`` with the
message the agent is shown instead of an observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

EDITOR_COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")

SYSTEM_PROMPT = """\
You are a software engineer fixing a bug in a Python repository checked out at /testbed. \
You work in a sandbox: no network, and only /testbed (plus a scratch /tmp that is emptied after \
every command) is writable.

Each of your messages ends with exactly one action, written at the start of a line:

bash: <command>
  Runs the command with bash in the sandbox; everything after "bash:" to the end of your message \
is the command (it may span several lines). The working directory and exported variables carry \
over to your next command; background processes do not. Commands are killed after a timeout. \
You see the output (its middle is cut when it is long) and the exit code.

str_replace_editor: <JSON object>
  Views and edits files. Examples:
  str_replace_editor: {"command": "view", "path": "/testbed/pkg/module.py", "view_range": [10, 40]}
  str_replace_editor: {"command": "create", "path": "/testbed/reproduce.py", "file_text": "print(1)\\n"}
  str_replace_editor: {"command": "str_replace", "path": "/testbed/pkg/module.py", \
"old_str": "x = 1", "new_str": "x = 2"}
  str_replace_editor: {"command": "insert", "path": "/testbed/pkg/module.py", "insert_line": 12, \
"new_str": "y = 3"}
  str_replace_editor: {"command": "undo_edit", "path": "/testbed/pkg/module.py"}
  "view" on a directory lists it; "old_str" must occur exactly once in the file; "insert" puts \
the text after line insert_line (0 for the top); "undo_edit" reverts your last edit of the file.

submit
  Ends the task. Your changes to /testbed are graded by running the repository's tests, \
including tests you cannot see.

Reason first if you like; only the action at the end of your message is executed. Reproduce \
the bug, fix it in the library's source (not in the tests), check the fix, then submit.\
"""

_ACTION = re.compile(r"^[ \t]*(bash:|str_replace_editor:|submit\b)", re.MULTILINE)
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)


@dataclass(frozen=True)
class Bash:
    command: str


@dataclass(frozen=True)
class Edit:
    args: dict[str, Any]


@dataclass(frozen=True)
class Submit:
    pass


@dataclass(frozen=True)
class Malformed:
    message: str


Action = Bash | Edit | Submit | Malformed

_USAGE = ("End your message with one action at the start of a line: `bash: <command>`, "
          "`str_replace_editor: {\"command\": ..., \"path\": ...}`, or `submit`.")


def parse_action(text: str) -> Action:
    text = _THINK.sub("", text)
    m = _ACTION.search(text)
    if m is None:
        return Malformed(f"No action found in your message. {_USAGE}")
    word, rest = m.group(1), text[m.end():]
    if word == "submit":
        return Submit()
    rest = re.sub(r"\n[ \t]*```[ \t]*\s*$", "", rest).strip()  # a closing code fence is not part of it
    if word == "bash:":
        if not rest:
            return Malformed(f"`bash:` needs a command after it, e.g. `bash: ls /testbed`. {_USAGE}")
        return Bash(rest)
    try:
        args = json.loads(rest)
    except json.JSONDecodeError as e:
        return Malformed(f"The str_replace_editor arguments are not valid JSON ({e.msg} at line {e.lineno} "
                         f"column {e.colno}); write one JSON object after `str_replace_editor:`. {_USAGE}")
    if not isinstance(args, dict):
        return Malformed(f"The str_replace_editor arguments must be a JSON object, got {type(args).__name__}.")
    if args.get("command") not in EDITOR_COMMANDS:
        return Malformed(f"str_replace_editor: unknown command {args.get('command')!r}; use one of "
                         f"{', '.join(EDITOR_COMMANDS)}.")
    if not isinstance(args.get("path"), str) or not args["path"]:
        return Malformed("str_replace_editor: the `path` argument (a file or directory under /testbed) is required.")
    return Edit(args)

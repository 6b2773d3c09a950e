"""The ``str_replace_editor`` tool (view / create / str_replace / insert / undo_edit), with
SWE-agent's and OpenHands' semantics and messages.

This file runs *inside the jail* (``python3 -c <this file>``, the request as JSON on stdin,
the reply as one JSON line on stdout), so the host never opens a file the agent controls: a
symlink or FIFO planted in the tree cannot reach outside it. Standard library only, and
Python 3.6 syntax (f-strings, no walrus), since SWE-bench images bring their own interpreter. The undo history stays
with the caller: every edit replies with the file's previous text, and ``undo_edit`` sends it
back.
"""

import json
import os
import sys

SNIPPET_LINES = 4
MAX_VIEW_CHARS = 16000


class EditorError(Exception):
    pass


def numbered(text, first=1):
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(text.split("\n"), first))


def read(path):
    if not os.path.isfile(path):
        raise EditorError(f"The path {path} does not exist or is not a regular file.")
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise EditorError(f"{path} is not a UTF-8 text file.") from None


def write(path, text):
    parent = os.path.dirname(path)
    if parent:
        os.makedirs(parent, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def snippet(path, text, line):
    lines = text.split("\n")
    start = max(0, line - SNIPPET_LINES)
    end = min(len(lines), line + SNIPPET_LINES + 1)
    return "The file {} has been edited. Here's the result of running `cat -n` on a snippet:\n{}\n" \
           "Review the changes and make sure they are as expected.".format(
               path, numbered("\n".join(lines[start:end]), start + 1))


def view(path, view_range):
    if os.path.isdir(path):
        out = []
        for top, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            depth = top[len(path):].count(os.sep)
            if depth >= 2:
                dirs[:] = []
            out += [os.path.join(top, n) for n in sorted(dirs + [f for f in files if not f.startswith(".")])]
        return "Files and directories up to 2 levels deep in {}, excluding hidden items:\n{}".format(
            path, "\n".join(sorted(out)))
    text = read(path)
    first = 1
    if view_range is not None:
        lines = text.split("\n")
        if (not isinstance(view_range, list) or len(view_range) != 2
                or not all(isinstance(x, int) for x in view_range)):
            raise EditorError("`view_range` must be a list of two integers, e.g. [10, 40].")
        start, end = view_range
        if not 1 <= start <= len(lines) or not (end == -1 or start <= end):
            raise EditorError(f"Invalid `view_range` {view_range}: lines are numbered 1 to {len(lines)}, "
                              "and the end must be -1 or not before the start.")
        text, first = "\n".join(lines[start - 1:] if end == -1 else lines[start - 1:end]), start
    out = numbered(text, first)
    if len(out) > MAX_VIEW_CHARS:
        out = out[:MAX_VIEW_CHARS] + "\n<response clipped: view a smaller `view_range`, or grep -n first>"
    return f"Here's the result of running `cat -n` on {path}:\n{out}"


def handle(req):
    command, path = req.get("command"), req.get("path")
    if not isinstance(path, str) or not path:
        raise EditorError("Parameter `path` is required.")
    path = os.path.normpath(os.path.join(req["root"], path))
    if command == "view":
        return {"observation": view(path, req.get("view_range"))}
    if command == "create":
        if os.path.lexists(path):
            raise EditorError(f"File already exists at: {path}. Cannot overwrite files using command `create`."
                              )
        if not isinstance(req.get("file_text"), str):
            raise EditorError("Parameter `file_text` is required for command: create.")
        write(path, req["file_text"])
        return {"observation": f"File created successfully at: {path}", "path": path, "previous": None}
    if command == "str_replace":
        old, new = req.get("old_str"), req.get("new_str", "")
        if not isinstance(old, str) or not old:
            raise EditorError("Parameter `old_str` is required for command: str_replace.")
        if not isinstance(new, str):
            raise EditorError("Parameter `new_str` must be a string.")
        text = read(path)
        count = text.count(old)
        if count == 0:
            raise EditorError(f"No replacement was performed, old_str `{old}` did not appear verbatim in {path}.")
        if count > 1:
            lines = [i + 1 for i, line in enumerate(text.split("\n")) if old.split("\n")[0] in line]
            raise EditorError(f"No replacement was performed. Multiple occurrences of old_str `{old}` in lines "
                              f"{lines}. Please ensure it is unique.")
        at = text.split(old)[0].count("\n")
        edited = text.replace(old, new)
        write(path, edited)
        return {"observation": snippet(path, edited, at + new.count("\n") // 2), "path": path, "previous": text}
    if command == "insert":
        line, new = req.get("insert_line"), req.get("new_str")
        if not isinstance(new, str):
            raise EditorError("Parameter `new_str` is required for command: insert.")
        text = read(path)
        lines = text.split("\n")
        if not isinstance(line, int) or not 0 <= line <= len(lines):
            raise EditorError(f"Invalid `insert_line` parameter: {line}. It should be within the range of lines "
                              f"of the file: [0, {len(lines)}]")
        edited = "\n".join(lines[:line] + new.split("\n") + lines[line:])
        write(path, edited)
        return {"observation": snippet(path, edited, line), "path": path, "previous": text}
    if command == "undo_edit":
        if "previous" not in req:
            raise EditorError(f"No edit history found for {path}.")
        if req["previous"] is None:
            os.unlink(path)
        else:
            write(path, req["previous"])
        return {"observation": f"Last edit to {path} undone successfully.", "path": path}
    raise EditorError(f"Unrecognized command {command!r}. The allowed commands are: view, create, str_replace, insert, "
                      "undo_edit.")


def main():
    try:
        reply = handle(json.loads(sys.stdin.read()))
        reply["ok"] = True
    except EditorError as e:
        reply = {"ok": False, "observation": str(e)}
    except OSError as e:
        reply = {"ok": False, "observation": f"{type(e).__name__}: {e}"}
    sys.stdout.write("\n" + json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()

"""``ast.parse`` that threads can share.

CPython 3.11's AST constructor tracks its recursion depth in interpreter-wide state, so two
threads parsing at once (the task builder tries candidate mutations in a thread pool) can fail
with ``SystemError: AST constructor recursion depth mismatch``. Parses are serialised here.
"""

from __future__ import annotations

import ast
import threading

_lock = threading.Lock()


def parse(source: str) -> ast.Module:
    """``ast.parse(source)`` under a process-wide lock; raises ``SyntaxError`` as it does."""
    with _lock:
        return ast.parse(source)

"""Tests located in their source files: shown in a problem statement, or cut out of the tree
the agent gets (and restored at grading by ``test_patch``).

A test id ``file::Class::name[param]`` names a function ``name`` in class ``Class`` of
``file``; every parametrization of it goes with it. Tests a file inherits (a mixin defined
elsewhere) are not in the file and stay visible.
"""

from __future__ import annotations

import ast
import textwrap

from .pyparse import parse

_DEFS = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _find(body: list[ast.stmt], test_id: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    node = None
    for name in (n.split("[", 1)[0] for n in test_id.split("::")[1:]):
        node = next((n for n in body if isinstance(n, _DEFS) and n.name == name), None)
        if node is None:
            return None
        body = node.body
    return node if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) else None


def _lines(node: ast.AST) -> tuple[int, int]:
    """1-based first (decorators included) and last line of a definition."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno


def source_of(text: str, test_id: str) -> str | None:
    """The source of the function ``test_id`` names, dedented, if the file defines it."""
    try:
        node = _find(parse(text).body, test_id)
    except SyntaxError:
        return None
    if node is None:
        return None
    first, last = _lines(node)
    return textwrap.dedent("\n".join(text.splitlines()[first - 1:last]))


def remove_tests(text: str, test_ids: list[str]) -> tuple[str, list[str]]:
    """``text`` without the functions of ``test_ids`` that it defines; (new text, ids removed).
    Nothing is removed when the result would not parse (a class left empty)."""
    body = parse(text).body
    spans, removed = set(), []
    for test_id in test_ids:
        if (node := _find(body, test_id)) is not None:
            spans.add(_lines(node))
            removed.append(test_id)
    lines = text.splitlines(keepends=True)
    for first, last in sorted(spans, reverse=True):
        del lines[first - 1:last]
    new = "".join(lines)
    try:
        parse(new)
    except SyntaxError:
        return text, []
    return new, removed

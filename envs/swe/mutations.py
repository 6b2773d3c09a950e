"""Bug injection by AST mutation (the SWE-smith procedural operators), as minimal text edits.

Every candidate is one edit inside one function body: the AST finds the site, and only the
site's own characters change (an operator token, a constant, a removed line), so the gold
patch that reverts it is a one-hunk diff that reads like a human's fix, not a reformatted
file. Operators:

- ``flip_comparison``   ``<``/``<=``, ``>``/``>=``, ``==``/``!=``, ``in``/``not in``, ``is``/``is not`` exchanged
- ``change_arithmetic`` ``+``/``-``, ``*``/``//``, ``<<``/``>>``, ``&``/``|`` exchanged; ``/`` -> ``*``, ``%`` -> ``//``
- ``flip_boolean``     ``and`` <-> ``or``; ``not x`` -> ``x``
- ``off_by_one``       an integer literal ``n`` -> ``n + 1`` and ``n - 1``
- ``remove_condition`` an ``if`` block without ``else`` deleted; one operand of ``a and b`` / ``a or b`` dropped
- ``remove_statement`` one single-line statement (assignment, call, return, raise, ...) deleted
- ``swap_arguments``   the first two positional arguments of a call exchanged
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from .pyparse import parse

OPERATORS = ("flip_comparison", "change_arithmetic", "flip_boolean", "off_by_one", "remove_condition",
             "remove_statement", "swap_arguments")

_COMPARE = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
            ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.In: ("in", "not in"),
            ast.NotIn: ("not in", "in"), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is")}
_ARITH = {ast.Add: ("+", "-"), ast.Sub: ("-", "+"), ast.Mult: ("*", "//"), ast.FloorDiv: ("//", "*"),
          ast.Div: ("/", "*"), ast.Mod: ("%", "//"), ast.LShift: ("<<", ">>"), ast.RShift: (">>", "<<"),
          ast.BitAnd: ("&", "|"), ast.BitOr: ("|", "&")}
_BOOL = {ast.And: ("and", "or"), ast.Or: ("or", "and")}
_REMOVABLE = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return, ast.Raise, ast.Break, ast.Continue,
              ast.Delete)


Edit = tuple[int, int, str]  # replace text[start:end] with the string


@dataclass(frozen=True)
class Mutation:
    path: str  # file, relative to the repository root
    operator: str
    function: str  # qualified name of the enclosing function
    line: int  # 1-based line of the edit in the original file
    description: str  # what changed, for logs only: never shown to the agent
    edit: Edit

    def apply(self, text: str) -> str | None:
        """The mutated file, or None when the edit does not parse (checked lazily: a library has
        thousands of sites and a build tries a few hundred)."""
        start, end, new = self.edit
        source = text[:start] + new + text[end:]
        try:
            parse(source)
        except SyntaxError:
            return None
        return source


class _Offsets:
    """Character offsets of AST positions (whose columns are UTF-8 byte offsets)."""

    def __init__(self, text: str):
        self.lines = text.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def at(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode()[:col].decode(errors="replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.at(node.lineno, node.col_offset), self.at(node.end_lineno, node.end_col_offset)


def _token_in_gap(text: str, start: int, end: int, token: str) -> tuple[int, int] | None:
    """Where ``token`` is in ``text[start:end]``, if the gap holds only it, brackets and blanks."""
    pattern = r"[\s()\\]*(" + r"\s+".join(re.escape(w) for w in token.split()) + r")[\s()\\]*"
    m = re.fullmatch(pattern, text[start:end])
    return (start + m.start(1), start + m.end(1)) if m else None


def _whole_lines(text: str, off: _Offsets, node: ast.stmt) -> tuple[int, int] | None:
    """The span of the full lines ``node`` occupies, when nothing else shares them."""
    a, b = off.span(node)
    line_start = off.starts[node.lineno - 1]
    line_end = off.starts[node.end_lineno]
    rest = text[b:line_end].strip()
    if text[line_start:a].strip() or (rest and not rest.startswith("#")):
        return None
    return line_start, line_end


class _Sites(ast.NodeVisitor):
    """Walks function bodies and yields (operator, function, line, description, edit)."""

    def __init__(self, text: str):
        self.text, self.off = text, _Offsets(text)
        self.stack: list[tuple[str, bool]] = []  # (name, is a function) of the enclosing definitions
        self.found: list[tuple[str, str, int, str, Edit]] = []

    @property
    def in_function(self) -> bool:
        return bool(self.stack) and self.stack[-1][1]

    def add(self, op: str, node: ast.AST, desc: str, edit: Edit) -> None:
        if self.in_function:
            self.found.append((op, ".".join(name for name, _ in self.stack), node.lineno, desc, edit))

    def visit_ClassDef(self, node):
        self.stack.append((node.name, False))
        for stmt in node.body:
            self.visit(stmt)
        self.stack.pop()

    def visit_FunctionDef(self, node):
        self.stack.append((node.name, True))
        self._block(node.body)
        for stmt in node.body:
            self.visit(stmt)  # decorators and defaults are not the function's behaviour
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_JoinedStr(self, node):
        pass  # positions inside f-strings are unreliable before Python 3.12

    def visit_Compare(self, node):
        left = node.left
        for op, right in zip(node.ops, node.comparators, strict=True):
            old, new = _COMPARE[type(op)]
            if gap := _token_in_gap(self.text, self.off.span(left)[1], self.off.span(right)[0], old):
                self.add("flip_comparison", node, f"{old} -> {new}", (*gap, new))
            left = right
        self.generic_visit(node)

    def visit_BinOp(self, node):
        if type(node.op) in _ARITH:
            old, new = _ARITH[type(node.op)]
            if gap := _token_in_gap(self.text, self.off.span(node.left)[1], self.off.span(node.right)[0], old):
                self.add("change_arithmetic", node, f"{old} -> {new}", (*gap, new))
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        if type(node.op) in _ARITH:
            old, new = (s + "=" for s in _ARITH[type(node.op)])
            if gap := _token_in_gap(self.text, self.off.span(node.target)[1], self.off.span(node.value)[0], old):
                self.add("change_arithmetic", node, f"{old} -> {new}", (*gap, new))
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        old, new = _BOOL[type(node.op)]
        for a, b in zip(node.values, node.values[1:], strict=False):
            if gap := _token_in_gap(self.text, self.off.span(a)[1], self.off.span(b)[0], old):
                self.add("flip_boolean", node, f"{old} -> {new}", (*gap, new))
        if len(node.values) == 2 and node.lineno == node.end_lineno:
            start, end = self.off.span(node)
            for keep in node.values:
                a, b = self.off.span(keep)
                self.add("remove_condition", node, f"keep only {self.text[a:b]!r}", (start, end, self.text[a:b]))
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not):
            start, _ = self.off.span(node)
            if m := re.match(r"not\s+", self.text[start:self.off.span(node.operand)[0]]):
                self.add("flip_boolean", node, "not x -> x", (start, start + m.end(), ""))
        self.generic_visit(node)

    def visit_Constant(self, node):
        if type(node.value) is int:
            start, end = self.off.span(node)
            if self.text[start:end].isdigit():
                for new in (node.value + 1, node.value - 1):
                    self.add("off_by_one", node, f"{node.value} -> {new}", (start, end, str(new)))

    def visit_Call(self, node):
        args = node.args
        if len(args) >= 2 and not any(isinstance(a, ast.Starred) for a in args[:2]):
            (a0, a1), (b0, b1) = self.off.span(args[0]), self.off.span(args[1])
            first, second = self.text[a0:a1], self.text[b0:b1]
            if first != second and a1 <= b0:
                self.add("swap_arguments", node, f"swap {first!r}, {second!r}",
                         (a0, b1, second + self.text[a1:b0] + first))
        self.generic_visit(node)

    def generic_visit(self, node):
        if isinstance(node, ast.stmt | ast.excepthandler | ast.match_case):
            for field in ("body", "orelse", "finalbody"):
                if isinstance(block := getattr(node, field, None), list):
                    self._block(block)
        super().generic_visit(node)

    def _block(self, block: list) -> None:
        """Deletions inside one statement list (never of its only statement: that would not parse)."""
        if len(block) > 1 and self.in_function:
            for stmt in block:
                self._removal(stmt)

    def _removal(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return  # docstrings and bare literals do nothing
        if isinstance(stmt, ast.If) and not stmt.orelse:
            if span := _whole_lines(self.text, self.off, stmt):
                self.add("remove_condition", stmt, "delete if-block", (*span, ""))
        elif isinstance(stmt, _REMOVABLE) and stmt.lineno == stmt.end_lineno:
            if span := _whole_lines(self.text, self.off, stmt):
                self.add("remove_statement", stmt, f"delete {type(stmt).__name__}", (*span, ""))


def mutations(path: str, text: str) -> list[Mutation]:
    """Every single-edit mutation site of ``text``, in source order."""
    try:
        tree = parse(text)
    except SyntaxError:
        return []
    sites = _Sites(text)
    for node in tree.body:
        sites.visit(node)
    return [Mutation(path, op, function, line, desc, edit) for op, function, line, desc, edit in sites.found]

"""Bug injection: each operator makes the one edit it names, inside function bodies only, and the
result still parses."""

import ast
import difflib

import pytest

from envs.swe.mutations import OPERATORS, mutations

SOURCE = '''\
LIMIT = 10  # module level: never mutated


class Window:
    size = 3  # class level: never mutated

    def slide(self, seq, step=1):
        """Docstrings stay."""
        out = []
        for i in range(0, len(seq) - self.size + 1, step):
            if i < 0 and not seq:
                continue
            out.append(seq[i:i + self.size])
        total = len(out) * 2
        return out, total
'''


def edits(op):
    result = []
    for m in mutations("w.py", SOURCE):
        if m.operator == op:
            new = m.apply(SOURCE)
            assert new is not None
            ast.parse(new)
            diff = [line for line in difflib.unified_diff(SOURCE.splitlines(), new.splitlines(), lineterm="", n=0)
                    if line[:1] in "+-" and line[:3] not in ("+++", "---")]
            result.append((m.description, diff))
    return result


def test_every_operator_finds_a_site():
    assert {m.operator for m in mutations("w.py", SOURCE)} == set(OPERATORS)


def test_only_function_bodies_are_mutated():
    lines = {m.line for m in mutations("w.py", SOURCE)}
    assert min(lines) >= 9 and all(m.function == "Window.slide" for m in mutations("w.py", SOURCE))


@pytest.mark.parametrize("op, description, diff", [
    ("flip_comparison", "< -> <=", ["-            if i < 0 and not seq:", "+            if i <= 0 and not seq:"]),
    ("change_arithmetic", "* -> //", ["-        total = len(out) * 2", "+        total = len(out) // 2"]),
    ("flip_boolean", "and -> or", ["-            if i < 0 and not seq:", "+            if i < 0 or not seq:"]),
    ("flip_boolean", "not x -> x", ["-            if i < 0 and not seq:", "+            if i < 0 and seq:"]),
    ("off_by_one", "2 -> 3", ["-        total = len(out) * 2", "+        total = len(out) * 3"]),
    ("remove_condition", "delete if-block", ["-            if i < 0 and not seq:", "-                continue"]),
    ("remove_condition", "keep only 'not seq'", ["-            if i < 0 and not seq:", "+            if not seq:"]),
    ("remove_statement", "delete Expr", ["-            out.append(seq[i:i + self.size])"]),
    ("swap_arguments", "swap '0', 'len(seq) - self.size + 1'",
     ["-        for i in range(0, len(seq) - self.size + 1, step):",
      "+        for i in range(len(seq) - self.size + 1, 0, step):"]),
])
def test_operator_makes_exactly_its_edit(op, description, diff):
    assert (description, diff) in edits(op)


def test_the_only_statement_of_a_block_is_never_removed():
    removed = [d for desc, d in edits("remove_statement")]
    assert ["-                continue"] not in removed  # would leave `if ...:` without a body

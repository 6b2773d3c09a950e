"""The action protocol: reasoning, then one action at the start of a line; malformed actions
get an explanation instead of an observation."""

import pytest

from envs.swe.actions import SYSTEM_PROMPT, Bash, Edit, Malformed, Submit, parse_action


@pytest.mark.parametrize("text, expected", [
    ("bash: ls -la", Bash("ls -la")),
    ("I should look around first.\nbash: cd /testbed\ngrep -rn foo .", Bash("cd /testbed\ngrep -rn foo .")),
    ("<think>bash: rm -rf /</think>\nbash: pytest -x", Bash("pytest -x")),
    ("```\nbash: python -m pytest tests\n```", Bash("python -m pytest tests")),
    ("All tests pass now.\nsubmit", Submit()),
    ('str_replace_editor: {"command": "view", "path": "/testbed/a.py"}',
     Edit({"command": "view", "path": "/testbed/a.py"})),
])
def test_well_formed_actions(text, expected):
    assert parse_action(text) == expected


@pytest.mark.parametrize("text, explains", [
    ("I think the bug is in foo.", "No action found"),
    ("bash:   ", "needs a command"),
    ('str_replace_editor: {"command": "view", "path": ', "not valid JSON"),
    ('str_replace_editor: ["view"]', "must be a JSON object"),
    ('str_replace_editor: {"command": "delete", "path": "/testbed/a.py"}', "unknown command 'delete'"),
    ('str_replace_editor: {"command": "view"}', "`path` argument"),
])
def test_malformed_actions_are_explained(text, explains):
    action = parse_action(text)
    assert isinstance(action, Malformed) and explains in action.message


def test_system_prompt_documents_every_action():
    for word in ("bash:", "str_replace_editor:", "submit", "view", "create", "str_replace", "insert", "undo_edit"):
        assert word in SYSTEM_PROMPT

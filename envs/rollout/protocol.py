"""The environment protocol every environment implements (TextWorld, ALFWorld, SWE, ...).

Text in, text out, gym-like: ``reset(task) -> first observation``, ``step(action) ->
(observation, reward, done, info)``. Tasks come from a ``TaskSet`` with train/eval
splits; ``expert_action`` (optional) returns a correct next action for SFT data and
tests. An environment may also bound the length of the next assistant message
(``answer_budget``): the agent loop reads it before each turn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Task:
    task_id: str
    split: str  # "train" | "eval" | other named splits
    payload: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass
class StepResult:
    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    system_prompt: str

    def reset(self, task: Task) -> str: ...

    def step(self, action: str) -> StepResult: ...

    def expert_action(self) -> str | None: ...

    def close(self) -> None: ...


def answer_budget(env: Environment) -> int | None:
    """The most tokens the next assistant message may take, where the environment bounds it: an optional
    ``max_new_tokens() -> int | None`` method (e.g. an answer-length budget per turn, or a replay of recorded
    episodes whose turns must have their recorded lengths). None: no bound of its own (the episode
    config's ``max_new_tokens`` applies; a bound from the environment can only lower it)."""
    bound = getattr(env, "max_new_tokens", None)
    n = bound() if callable(bound) else None
    if n is not None and n < 1:
        raise ValueError(f"{type(env).__name__}.max_new_tokens() must be >= 1 or None, got {n}")
    return n


def turn_cap_hook(env: Environment) -> Callable[[], StepResult | None] | None:
    """An environment's optional ``at_turn_cap() -> StepResult | None``: what an episode cut by its turn or token
    cap still gets (SWE: its diff submitted and graded, SWE-agent's autosubmission). None: nothing."""
    hook = getattr(env, "at_turn_cap", None)
    return hook if callable(hook) else None


@runtime_checkable
class TaskSet(Protocol):
    def tasks(self, split: str) -> list[Task]: ...

    def make_env(self, expert: bool = False) -> Environment:
        """A fresh environment. ``expert``: its ``expert_action`` must answer (SFT data, the BPE corpus); without
        it an environment may skip the expert's bookkeeping (TextWorld's plan costs ~60% of a step's CPU)."""
        ...

    # Optional: ``games_version``, a string naming how the games are made (generator, build), so that expert
    # episodes played on one machine serve another's SFT only where both make the same games (harness.sft).

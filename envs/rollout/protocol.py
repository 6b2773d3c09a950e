"""The environment protocol every environment implements (TextWorld, ALFWorld, SWE, ...).

Text in, text out, gym-like: ``reset(task) -> first observation``, ``step(action) ->
(observation, reward, done, info)``. Tasks come from a ``TaskSet`` with train/eval
splits; ``expert_action`` (optional) returns a correct next action for SFT data and
tests.
"""

from __future__ import annotations

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


@runtime_checkable
class TaskSet(Protocol):
    def tasks(self, split: str) -> list[Task]: ...

    def make_env(self) -> Environment: ...

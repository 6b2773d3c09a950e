"""Corridor: walk through ``rooms`` rooms; each room says which door leads on.

Each observation names the correct door (``LEFT`` or ``RIGHT``); the agent passes the
room by choosing it, otherwise it bumps into a wall and stays. Reward: 1/rooms per room
passed, so an episode earns between 0 and 1. The action is read leniently -- "left" or
"right" when the text starts with one, otherwise whether its first character is ASCII --
so that an untrained byte-level model explores both doors and RL has a signal from the
first step (this environment exists to test the RL loop, not language skill). With
``doors="left"`` every exit is on the left: the policy only has to learn a preference,
the quickest signal for a learning check; ``"random"`` makes it read the hint.
"""

from __future__ import annotations

import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..rollout.protocol import StepResult, Task


def read_door(action: str) -> str:
    text = action.strip().lower()
    if text.startswith("left"):
        return "LEFT"
    if text.startswith("right"):
        return "RIGHT"
    # Anything else: an ASCII first character means left. A random byte-level model starts
    # with an ASCII byte about 40% of the time (other bytes decode to U+FFFD), so both
    # doors are explored and the choice is a broad class of tokens, easy to shift.
    return "LEFT" if text[:1].isascii() and text[:1] != "" else "RIGHT"


class Corridor:
    system_prompt = "You walk through a corridor of rooms. In each room answer with the door to take: left or right."

    def __init__(self, rooms: int = 3, doors: str = "random"):
        if doors not in ("random", "left"):
            raise ValueError(f"doors must be 'random' (read the hint) or 'left' (always left), got {doors!r}")
        self.rooms, self.door_rule = rooms, doors
        self.doors: list[str] = []
        self.room = 0

    def _observation(self) -> str:
        return f"Room {self.room + 1} of {self.rooms}. The exit is the {self.doors[self.room]} door."

    def reset(self, task: Task) -> str:
        rng = random.Random(task.task_id)
        choices = ["LEFT", "RIGHT"] if self.door_rule == "random" else ["LEFT"]
        self.doors = [rng.choice(choices) for _ in range(self.rooms)]
        self.room = 0
        return self._observation()

    def step(self, action: str) -> StepResult:
        if read_door(action) != self.doors[self.room]:
            return StepResult(f"You bump into a wall. {self._observation()}", 0.0, False, {"won": False})
        self.room += 1
        if self.room == self.rooms:
            return StepResult("You are out of the corridor.", 1.0 / self.rooms, True, {"won": True})
        return StepResult(self._observation(), 1.0 / self.rooms, False, {"won": False})

    def expert_action(self) -> str | None:
        return self.doors[self.room].lower() if self.room < self.rooms else None

    def close(self) -> None:
        pass


class CorridorOptions(BaseModel):
    """``environment.options`` of a toy run: ``CorridorTasks``'s arguments."""

    model_config = ConfigDict(extra="forbid")

    rooms: int = Field(3, ge=1)
    num_train: int = Field(1000, ge=0)
    num_eval: int = Field(64, ge=0)
    doors: Literal["random", "left"] = Field("random", description="random: read the hint; left: always left")


class CorridorTasks:
    """Deterministic task ids: ``train-i`` and ``eval-i`` draw their doors from their id."""

    def __init__(self, rooms: int = 3, num_train: int = 1000, num_eval: int = 64, doors: str = "random"):
        self.rooms, self.num_train, self.num_eval, self.doors = rooms, num_train, num_eval, doors

    def tasks(self, split: str) -> list[Task]:
        n = self.num_train if split == "train" else self.num_eval
        return [Task(f"{split}-{i}", split) for i in range(n)]

    def make_env(self, expert: bool = False) -> Corridor:  # the expert costs nothing here
        return Corridor(self.rooms, self.doors)

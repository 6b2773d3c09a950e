"""Corridor: walk through ``rooms`` rooms; each room says which door leads on.

Each observation names the correct door (``LEFT`` or ``RIGHT``); the agent passes the
room by choosing it, otherwise it bumps into a wall and stays. Reward: 1/rooms per room
passed, so an episode earns between 0 and 1. The action is read leniently -- "left"/"l"
or "right"/"r" when the text starts with one, otherwise the parity of its first byte --
so that an untrained byte-level model explores both doors and RL has a signal from the
first step (this environment exists to test the RL loop, not language skill).
"""

from __future__ import annotations

import random

from ..protocol import StepResult, Task


def read_door(action: str) -> str:
    text = action.strip().lower()
    if text.startswith(("left", "l")):
        return "LEFT"
    if text.startswith(("right", "r")):
        return "RIGHT"
    first = text.encode("utf-8")[:1]
    return "LEFT" if not first or first[0] % 2 == 0 else "RIGHT"


class Corridor:
    system_prompt = "You walk through a corridor of rooms. In each room answer with the door to take: left or right."

    def __init__(self, rooms: int = 3):
        self.rooms = rooms
        self.doors: list[str] = []
        self.room = 0

    def _observation(self) -> str:
        return f"Room {self.room + 1} of {self.rooms}. The exit is the {self.doors[self.room]} door."

    def reset(self, task: Task) -> str:
        rng = random.Random(task.task_id)
        self.doors = [rng.choice(["LEFT", "RIGHT"]) for _ in range(self.rooms)]
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


class CorridorTasks:
    """Deterministic task ids: ``train-i`` and ``eval-i`` draw their doors from their id."""

    def __init__(self, rooms: int = 3, num_train: int = 1000, num_eval: int = 64):
        self.rooms, self.num_train, self.num_eval = rooms, num_train, num_eval

    def tasks(self, split: str) -> list[Task]:
        n = self.num_train if split == "train" else self.num_eval
        return [Task(f"{split}-{i}", split) for i in range(n)]

    def make_env(self) -> Corridor:
        return Corridor(self.rooms)

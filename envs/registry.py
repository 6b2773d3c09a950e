"""Environment name -> task set, the one place the harness looks environments up.

Heavy environments are imported only when asked for, so a toy run needs none of their
packages installed."""

from __future__ import annotations

from typing import Any

from .rollout.protocol import TaskSet


def make_taskset(name: str, options: dict[str, Any] | None = None) -> TaskSet:
    options = options or {}
    if name == "toy":
        from .toy import CorridorTasks

        return CorridorTasks(**options)
    if name == "textworld":
        from .textworld.tasks import TextWorldConfig, TextWorldTasks

        return TextWorldTasks(TextWorldConfig(**options))
    if name == "alfworld":
        from .alfworld.tasks import AlfWorldConfig, AlfWorldTasks

        return AlfWorldTasks(AlfWorldConfig(**options))
    if name == "swe":
        from .swe.env import SweTaskSet

        return SweTaskSet(**options)
    raise ValueError(f"unknown environment {name!r}: expected toy, textworld, alfworld or swe")

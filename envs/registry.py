"""Environment name -> task set, the one place the harness looks environments up.

Heavy environments are imported only when asked for, so a toy run needs none of their
packages installed. Each environment's options are a pydantic model (unknown keys refused):
the harness validates ``environment.options`` against it with the rest of the config."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from .rollout.protocol import TaskSet

NAMES = ("toy", "textworld", "alfworld", "swe")


def options_model(name: str) -> type[BaseModel]:
    """The model ``environment.options`` of environment ``name`` must validate against."""
    if name == "toy":
        from .toy import CorridorOptions

        return CorridorOptions
    if name == "textworld":
        from .textworld.tasks import TextWorldConfig

        return TextWorldConfig
    if name == "alfworld":
        from .alfworld.tasks import AlfWorldConfig

        return AlfWorldConfig
    if name == "swe":
        from .swe.env import SweTaskSetOptions

        return SweTaskSetOptions
    raise ValueError(f"unknown environment {name!r}: expected one of {', '.join(NAMES)}")


def make_taskset(name: str, options: dict[str, Any] | None = None, *, processes: int = 0) -> TaskSet:
    """Environment ``name``'s task set; ``processes`` > 0: its environments live in that many worker processes
    (``rollout.env_processes``; close the task set when done)."""
    taskset = _make_taskset(name, options)
    if processes:
        from .rollout.env_processes import ProcessTaskSet

        return ProcessTaskSet(taskset, processes)
    return taskset


def _make_taskset(name: str, options: dict[str, Any] | None) -> TaskSet:
    opts = options_model(name).model_validate(options or {})
    if name == "toy":
        from .toy import CorridorTasks

        return CorridorTasks(**dict(opts))
    if name == "textworld":
        from .textworld.tasks import TextWorldTasks

        return TextWorldTasks(opts)
    if name == "alfworld":
        from .alfworld.tasks import AlfWorldTasks

        return AlfWorldTasks(opts)
    from .swe.env import SweTaskSet

    return SweTaskSet(**dict(opts))

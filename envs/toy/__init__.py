"""A small multi-turn toy environment a tiny model can learn on a CPU in minutes."""

from .corridor import Corridor, CorridorOptions, CorridorTasks

__all__ = ["Corridor", "CorridorOptions", "CorridorTasks"]

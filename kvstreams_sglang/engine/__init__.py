"""The built-in engine (HF model + KV streams + our attention backends)."""

from .engine import Engine, EngineStats, Generation, StepInfo
from .sampling import SamplingParams

__all__ = ["Engine", "EngineStats", "Generation", "SamplingParams", "StepInfo"]

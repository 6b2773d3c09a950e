"""The built-in engine (HF model + KV streams + our attention backends)."""

from .config import EngineConfig
from .engine import Engine, EngineStats, Generation, StepInfo
from .sampling import SamplingParams

__all__ = ["Engine", "EngineConfig", "EngineStats", "Generation", "SamplingParams", "StepInfo"]

"""The TextWorld task set: deterministic train and held-out eval games, generated on first use.

Game ``i`` of a split is preset ``presets[i % len(presets)]`` with seed ``first_seed(split) + i``;
train and eval seeds never meet, so the eval games are held out by construction (see
``presets.py`` for the generators' own held-out distributions).
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from envs.rollout.protocol import Task

from .env import SYSTEM_PROMPT, TextWorldEnv
from .generate import GameSpec, default_cache_dir, fingerprint, generate_games
from .presets import PRESETS, first_seed


class TextWorldConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    presets: list[str] = Field(["short"], min_length=1, description="games cycle through these presets")
    n_train: int = Field(64, ge=0, description="training games (the paper: 60,000)")
    n_eval: int = Field(16, ge=0, description="held-out evaluation games (the paper: 256)")
    cache_dir: Path | None = Field(None, description="default: $KVSTREAMS_CACHE/textworld or ~/.cache/kvstreams/...")
    workers: int | None = Field(None, ge=1, description="generation processes (default: one per core)")
    progress: bool = True
    max_steps: int = Field(100, ge=1, description="commands per episode before it is cut")
    score_weight: float = Field(1.0, description="reward per full max_score of points")
    win_bonus: float = Field(1.0, description="reward added on the winning step")
    list_commands: bool = Field(False, description="append the admissible commands to every observation")
    expert: bool = Field(False, description="track TextWorld's plan in every environment (~2.5x the CPU of a step); "
                         "environments asked for the expert (make_env(expert=True): SFT, the corpus) always do")
    system_prompt: str = Field(SYSTEM_PROMPT, min_length=1, description="a small model trained from scratch "
                                                                       "needs none of the default's advice")

    @field_validator("presets")
    @classmethod
    def _known(cls, presets: list[str]) -> list[str]:
        unknown = [p for p in presets if p not in PRESETS]
        if unknown:
            raise ValueError(f"unknown presets {unknown}; known: {sorted(PRESETS)}")
        return presets


class TextWorldTasks:
    def __init__(self, config: TextWorldConfig | None = None):
        self.config = config or TextWorldConfig()
        self.cache_dir = Path(self.config.cache_dir or default_cache_dir())

    def specs(self, split: str) -> list[GameSpec]:
        presets, start = self.config.presets, first_seed(split)
        n = self.config.n_train if split == "train" else self.config.n_eval
        return [GameSpec(presets[i % len(presets)], split, start + i) for i in range(n)]

    def tasks(self, split: str) -> list[Task]:
        specs = self.specs(split)
        paths = generate_games(specs, self.cache_dir, workers=self.config.workers, progress=self.config.progress)
        return [Task(f"{s.preset}-{s.split}-{s.seed}", split, {"path": str(p), "preset": s.preset, "seed": s.seed})
                for s, p in zip(specs, paths, strict=True)]

    @property
    def games_version(self) -> str:
        return "textworld-" + ",".join(f"{p}-{fingerprint(p)}" for p in self.config.presets)

    def make_env(self, expert: bool = False) -> TextWorldEnv:
        c = self.config
        return TextWorldEnv(max_steps=c.max_steps, score_weight=c.score_weight, win_bonus=c.win_bonus,
                            list_commands=c.list_commands, expert=expert or c.expert, system_prompt=c.system_prompt)

"""The ALFWorld task set: train on ``valid_train``, evaluate on ``valid_seen`` (in
distribution) and ``valid_unseen`` (unseen rooms); see ``data.py`` for the files.

The task set owns the pool of player processes its environments lease; ``close()`` it (or
let the interpreter exit) to end them.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from envs.rollout.protocol import Task

from .data import ARCHIVE, GameFiles
from .env import AlfWorldEnv
from .worker import GamePool


class AlfWorldConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cache_dir: Path | None = Field(None, description="default: $KVSTREAMS_CACHE/alfworld or ~/.cache/kvstreams/...")
    archive: Path = Field(ARCHIVE, description="used when $ALFWORLD_DATA has no json_2.1.1/")
    train_dir: str = Field("valid_train", description="release folder of the train split ('train': the full set)")
    train_variants: int = Field(0, ge=0, description="more train games per train trial: its room with the objects "
                                "placed again (envs/alfworld/variants.py)")
    max_steps: int = Field(50, ge=1, description="commands per episode before it is cut")
    win_reward: float = 1.0
    expert: bool = Field(True, description="run the hand-coded expert (needed for expert_action)")
    list_commands: bool = Field(False, description="append the admissible commands to every observation")
    timeout: float = Field(300.0, gt=0, description="seconds a game process may take to answer")


class AlfWorldTasks:
    def __init__(self, config: AlfWorldConfig | None = None):
        self.config = c = config or AlfWorldConfig()
        self.files = GameFiles(c.cache_dir, c.archive, c.train_dir, c.train_variants)
        self.pool = GamePool(expert=c.expert, expert_steps=max(200, 4 * c.max_steps), timeout=c.timeout)

    def tasks(self, split: str) -> list[Task]:
        """``split``: train, eval_seen, eval_unseen or eval (both)."""
        return [Task(trial_id, split, {"gamefile": str(game), "task_type": trial_id.split("/")[1].split("-")[0]})
                for trial_id, game in self.files.games(split)]

    @property
    def games_version(self) -> str:
        return self.files.version

    def make_env(self, expert: bool = False) -> AlfWorldEnv:
        c = self.config
        if expert and not c.expert:  # the pool's processes run the expert or not, for every environment
            raise ValueError("an ALFWorld environment with its expert was asked for (SFT data, the BPE corpus), but "
                             "environment.options.expert = false starts the game processes without it")
        return AlfWorldEnv(self.pool, max_steps=c.max_steps, win_reward=c.win_reward, list_commands=c.list_commands)

    def close(self) -> None:
        self.pool.close()

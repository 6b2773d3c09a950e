"""Drive a real environment through the agent loop with the built-in engine and a tiny model
(shared by the TextWorld and ALFWorld tests)."""

from __future__ import annotations

import asyncio

from transformers import AutoTokenizer

from envs.rollout.agent_loop import Episode, EpisodeConfig, run_episodes
from envs.rollout.chat import ChatRenderer
from envs.rollout.client import BuiltinClient
from envs.rollout.compaction import CompactionConfig
from envs.rollout.protocol import Task
from kvstreams_sglang.engine import Engine


def play_tiny(tiny_model_path, make_env, system_prompt: str, tasks: list[Task], strategy: str, *,
              turns: int = 5) -> tuple[list[Episode], AutoTokenizer]:
    """``turns`` turns of each task, concurrently, with compaction after 3 live turns."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    engine = Engine(str(tiny_model_path), kv_slots=16384, max_streams=8)
    renderer = ChatRenderer(tokenizer, system_prompt)
    compaction = CompactionConfig(strategy=strategy, window_turns=3, stride=2, summary_max_tokens=6, pick_max_tokens=5)
    config = EpisodeConfig(max_turns=turns, max_new_tokens=6)
    episodes = asyncio.run(run_episodes(BuiltinClient(engine), make_env, tasks, renderer, compaction, config, seed=1))
    return episodes, tokenizer


def env_text(record, tokenizer) -> str:
    """Everything the environment side put into a stream (prompts, observations, chat tags)."""
    return tokenizer.decode([t for t, s in zip(record.token_ids, record.sources, strict=True) if s != "model"])

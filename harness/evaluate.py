"""Held-out evaluation: episodes on the eval split, through the engine and the agent loop.

The same path as training rollouts (engine streams, the run's compaction strategy and
KV dtype), at the evaluation temperature (0: greedy), one episode per held-out game.
Besides win rate and reward it measures, from the episodes' records, the KV an episode
held: the most keys any of its tokens attended to (``kv_peaks``), against what the same
stream would hold with nothing evicted.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from envs.rollout.agent_loop import Episode, EpisodeConfig, run_episodes
from envs.rollout.chat import ChatRenderer
from envs.rollout.client import BuiltinClient, EngineClient
from envs.rollout.protocol import Task, TaskSet
from kvstreams_sglang.engine import Engine
from trainer_masks import StreamRecord

from .config import Config


def kv_peaks(record: StreamRecord) -> tuple[int, int]:
    """``(peak live, full context)`` KV tokens of a KV-streams record: the most keys one
    query saw (``k <= q < death[k]``), and the stream's length, which a query at its end
    would have seen had nothing been evicted."""
    n = len(record.token_ids)
    died_at = [0] * (n + 1)
    for d in record.death():
        died_at[d] += 1
    peak, dead = 0, 0
    for q in range(n):
        dead += died_at[q]
        peak = max(peak, q + 1 - dead)
    return peak, n


@dataclass
class EvalResult:
    stage: str
    episodes: int
    wins: int
    mean_reward: float
    mean_turns: float
    tokens_reprefilled: int  # by the agent loop (re-prefill execution) and by the engine
    peak_kv_tokens: int  # max over episodes of kv_peaks()[0]
    full_context_tokens: int  # max over episodes of kv_peaks()[1]
    compactions: int
    seconds: float = 0.0  # the evaluation's wall time (not a run's GPU time: runs exclude their evaluations)

    @property
    def win_rate(self) -> float:
        return self.wins / max(1, self.episodes)

    def as_dict(self) -> dict:
        return {**asdict(self), "win_rate": self.win_rate}


def make_engine(cfg: Config, model_path: str, device: torch.device) -> Engine:
    """The run's inference engine (KV dtype, pool, INT8 side cache) on ``model_path``."""
    return Engine.from_config(model_path, cfg.inference, device=device,
                              dtype=torch.float32 if device.type == "cpu" else None)


def held_out_tasks(taskset: TaskSet, cfg: Config) -> dict[str, list[Task]]:
    """The eval games of each split of ``cfg.evaluation.splits`` (default: the environment's eval split), the
    first ``environment.num_eval`` of each."""
    splits = cfg.evaluation.splits or [cfg.environment.eval_split]
    return {split: taskset.tasks(split)[:cfg.environment.num_eval] for split in splits}


class HeldOut:
    """Held-out evaluation of a policy being trained: one engine of its own (the run's KV dtype, pool and
    compaction), built on first use and given the policy's weights before each evaluation; or, given ``client``,
    the run's inference server, which holds the policy's weights already (the harness syncs them every step)."""

    def __init__(self, cfg: Config, model_path: str, device: torch.device, taskset: TaskSet, renderer: ChatRenderer,
                 client: EngineClient | None = None):
        self.cfg, self.model_path, self.device = cfg, model_path, device
        self.taskset, self.renderer = taskset, renderer
        self.tasks = held_out_tasks(taskset, cfg)
        self.engine: Engine | None = None
        self.client = client

    async def evaluate(self, weights: dict[str, torch.Tensor]) -> list[EvalResult]:
        """One result per split (its ``stage`` is the split's name)."""
        if self.client is None:
            self.engine = self.engine or make_engine(self.cfg, self.model_path, self.device)
            self.engine.update_weights(weights)
        results = []
        for split, tasks in self.tasks.items():
            result, _ = await evaluate(split, self.client or self.engine, self.taskset, tasks, self.renderer,
                                       self.cfg, temperature=self.cfg.evaluation.temperature, seed=self.cfg.run.seed)
            results.append(result)
        return results


def episode_config(cfg: Config, temperature: float) -> EpisodeConfig:
    return cfg.orchestrator.episode.model_copy(update=dict(temperature=temperature))


async def evaluate(stage: str, engine: Engine | EngineClient, taskset: TaskSet, tasks: list[Task],
                   renderer: ChatRenderer, cfg: Config, *, temperature: float = 0.0,
                   seed: int = 0) -> tuple[EvalResult, list[Episode]]:
    """One episode per task on ``engine`` (a built-in engine, or a client of any engine); a progress bar while they
    run."""
    from rich.progress import Progress

    client = BuiltinClient(engine) if isinstance(engine, Engine) else engine
    before = client.tokens_reprefilled
    t0 = time.perf_counter()
    with Progress(transient=True) as progress:
        bar = progress.add_task(f"eval {stage}", total=len(tasks))
        episodes = await run_episodes(client, taskset.make_env, tasks, renderer, cfg.compaction,
                                      episode_config(cfg, temperature), concurrency=cfg.inference.max_streams,
                                      seed=seed, on_episode=lambda _: progress.advance(bar))
    peaks = [kv_peaks(r) for ep in episodes for r in ep.records]
    n = len(episodes)
    result = EvalResult(
        stage=stage, episodes=n, wins=sum(ep.won for ep in episodes),
        mean_reward=sum(ep.reward for ep in episodes) / max(1, n),
        mean_turns=sum(ep.stats.turns for ep in episodes) / max(1, n),
        tokens_reprefilled=sum(ep.stats.tokens_reprefilled for ep in episodes)
        + client.tokens_reprefilled - before,
        peak_kv_tokens=max((p for p, _ in peaks), default=0),
        full_context_tokens=max((f for _, f in peaks), default=0),
        compactions=sum(ep.stats.compactions for ep in episodes), seconds=round(time.perf_counter() - t0, 2))
    return result, episodes

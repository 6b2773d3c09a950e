"""How many turns a second the harness's process can play, with the environments stepped in it or in worker
processes (``environment.processes``, ``envs.rollout.env_processes``).

The engine is taken out of the measure: each episode's client writes the commands the expert played on that game
(recorded beforehand, ``harness.sft.ExpertClient`` over a script), so what is timed is the harness's own work per turn
-- the agent loop, the chat rendering, the stream ledger, the compaction -- and the environments' steps (TextWorld's
RL environments: no expert planning). Per setting: turns/s, and the harness process's CPU seconds per turn (its
threads included, its workers not). On the H100 host (2026-12-06) the learning bench's server stayed near idle while
the harness, stepping the games itself, played ~200 turns/s.

    python -m bench.env_processes --config configs/textworld/gpu_small.toml --model M --episodes 128 \\
        --processes 0 2 --json bench/results/env_processes_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path


class Script:
    """An environment stand-in for ``ExpertClient``: the next recorded command (the episode's own environment,
    maybe in another process, is the one stepped)."""

    def __init__(self, commands: list[str]):
        self.commands = list(commands)

    def expert_action(self) -> str | None:
        return self.commands.pop(0) if self.commands else None


def expert_plans(taskset, tasks, max_turns: int) -> list[list[str]]:
    """The expert's commands on each task (played here once, not timed)."""
    env, plans = taskset.make_env(expert=True), []
    for task in tasks:
        env.reset(task)
        plan = []
        while len(plan) < max_turns and (action := env.expert_action()) is not None:
            plan.append(action)
            if env.step(action).done:
                break
        plans.append(plan)
    env.close()
    return plans


async def play(taskset, tasks, plans, renderer, cfg) -> dict:
    from envs.rollout.agent_loop import run_episode
    from harness.sft import ExpertClient

    async def one(task, plan):
        env = taskset.make_env()
        return await run_episode(ExpertClient(Script(plan), renderer), env, task, renderer, cfg.compaction,
                                 cfg.orchestrator.episode)

    cpu, t0 = time.process_time(), time.perf_counter()
    episodes = await asyncio.gather(*(one(t, p) for t, p in zip(tasks, plans, strict=True)))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu
    turns = sum(ep.stats.turns for ep in episodes)
    return {"episodes": len(episodes), "turns": turns, "wins": sum(ep.won for ep in episodes), "wall_s": round(wall, 2),
            "turns_per_s": round(turns / wall, 1), "harness_cpu_ms_per_turn": round(1000 * cpu / turns, 3)}


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from transformers import AutoTokenizer

    from envs.registry import make_taskset
    from envs.rollout.chat import ChatRenderer
    from harness.config import load_config

    from .learning import LearningConfig  # a harness config, or the learning bench's (its extra sections)

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True, help="a harness TOML: its environment, compaction and episode")
    p.add_argument("--model", required=True, help="a checkpoint directory: its tokenizer renders the chat")
    p.add_argument("--episodes", type=int, default=128, help="played at once (the orchestrator's pool)")
    p.add_argument("--processes", type=int, nargs="+", default=[0, 2], help="settings: 0 = in the harness process")
    p.add_argument("--json", type=Path, default=None)
    args, overrides = p.parse_known_args(argv)
    cfg = load_config(args.config, overrides, schema=LearningConfig)
    console = Console()
    e = cfg.environment
    base = make_taskset(e.name, e.options)
    tasks = (base.tasks(e.train_split) * args.episodes)[:args.episodes]
    renderer = ChatRenderer(AutoTokenizer.from_pretrained(args.model), base.make_env().system_prompt)
    plans = expert_plans(base, tasks, cfg.orchestrator.episode.max_turns)
    rows = []
    for n in args.processes:
        taskset = make_taskset(e.name, e.options, processes=n) if n else base
        try:
            if n:  # the workers' start (spawn, imports) is not the rate: one episode first
                asyncio.run(play(taskset, tasks[:n], plans[:n], renderer, cfg))
            row = {"processes": n, **asyncio.run(play(taskset, tasks, plans, renderer, cfg))}
        finally:
            if n:
                taskset.close()
        rows.append(row)
        console.print(row)
    report = {"command": " ".join(["python", "-m", "bench.env_processes", *(argv or sys.argv[1:])]),
              "cpus": os.cpu_count(), "environment": e.name, "options": e.options,
              "compaction": cfg.compaction.model_dump(mode="json"), "rows": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Environments in worker processes (``envs.rollout.env_processes``, ``environment.processes``): the protocol's
calls forwarded, errors raised where the call was made, optional hooks only where the environment has them, and a
run of the harness with its environments in two processes. TextWorld's games in workers: tests/test_textworld.py."""

import asyncio
import os

import pytest

from envs.rollout.env_processes import EnvProcessError, ProcessTaskSet
from envs.rollout.protocol import StepResult, Task, answer_budget, turn_cap_hook
from envs.toy.corridor import CorridorTasks
from harness.config import load_config
from harness.run import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BudgetedCorridor(CorridorTasks):
    """The corridor, with an answer budget per turn (an optional protocol hook)."""

    def make_env(self, expert: bool = False):
        env = super().make_env(expert)
        env.max_new_tokens = lambda: 7
        return env


def test_the_corridor_plays_the_same_in_a_worker_process():
    tasks = CorridorTasks(rooms=4)
    remote = ProcessTaskSet(tasks, 1)
    try:
        for task in tasks.tasks("train")[:3]:
            here, there = tasks.make_env(), remote.make_env()
            assert there.reset(task) == here.reset(task)
            for action in ["left", "right", "left", "right", "left"]:
                a, b = here.step(action), there.step(action)
                assert isinstance(b, StepResult) and (a.observation, a.reward, a.done) == (b.observation, b.reward,
                                                                                          b.done)
                if a.done:
                    break
            there.close()
            there.close()  # twice: nothing more
        assert answer_budget(there) is None and turn_cap_hook(there) is None  # the corridor has neither hook
    finally:
        remote.close()


def test_a_worker_raises_the_environments_error_where_the_call_was_made():
    remote = ProcessTaskSet(CorridorTasks(), 1)
    try:
        env = remote.make_env()
        with pytest.raises(EnvProcessError, match=r"IndexError.*in environment worker \d+"):
            env.step("left")  # before any reset: no doors yet
        env.reset(Task("train-0", "train"))  # the worker serves on
        assert env.step("left").observation
    finally:
        remote.close()
    with pytest.raises(EnvProcessError, match="exited"):
        env.step("left")


class SlowCorridor(CorridorTasks):
    """The corridor, whose steps take a second: long enough to kill its worker during one."""

    def make_env(self, expert: bool = False):
        import time

        env = super().make_env(expert)
        step = env.step
        env.step = lambda action: (time.sleep(1.0), step(action))[1]
        return env


def test_a_worker_killed_during_a_call_is_an_error_there_not_a_hang():
    import threading

    remote = ProcessTaskSet(SlowCorridor(), 1)
    try:
        env = remote.make_env()
        env.reset(Task("train-0", "train"))
        threading.Timer(0.3, remote.workers[0].process.kill).start()
        with pytest.raises(EnvProcessError, match="exited during step"):
            env.step("left")
    finally:
        remote.close()


def test_optional_hooks_are_forwarded_only_where_the_environment_has_them():
    remote = ProcessTaskSet(BudgetedCorridor(), 1)
    try:
        env = remote.make_env()
        assert answer_budget(env) == 7
        with pytest.raises(AttributeError):
            env.at_turn_cap  # noqa: B018 -- not a hook this environment has
    finally:
        remote.close()


def test_a_run_with_its_environments_in_two_worker_processes(tmp_path):
    cfg = load_config(os.path.join(ROOT, "configs/demo.toml"), [
        "--run.output_dir", str(tmp_path / "run"), "--run.steps", "2", "--run.checkpoint_every", "100",
        "--orchestrator.group_size", "2", "--orchestrator.groups_per_step", "2", "--orchestrator.episode.max_turns",
        "4", "--orchestrator.episode.env_in_thread", "false", "--environment.processes", "2"])
    rows = asyncio.run(run(cfg, overlap=False))
    assert [r["step"] for r in rows] == [0, 1] and all(r["turns"] > 0 for r in rows)

"""Text of a task set's episodes, to learn a tokenizer on (the tiny model's BPE vocabulary).

Each task of the split is reset and, where the environment has an expert, played through with
its actions: the system prompt, every observation and every action. Only the split asked for
is read (the train split for a model that is then evaluated on held-out tasks).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from .rollout.protocol import Environment, Task, TaskSet


def expert_episode_text(env: Environment, task: Task, *, max_steps: int = 50) -> list[str]:
    """``task`` played by ``env``'s expert: the first observation, then each action and the answer to it."""
    texts = [env.reset(task)]
    for _ in range(max_steps):
        action = env.expert_action()
        if action is None:
            break
        result = env.step(action)
        texts += [action, result.observation]
        if result.done:
            break
    return texts


def episode_texts(taskset: TaskSet, split: str, *, max_steps: int = 50, workers: int = 1) -> Iterator[str]:
    """The system prompt, then every task's expert episode, in task order. ``workers`` threads play tasks at
    once, each with its own environment: environments that run their games in other processes (ALFWorld: a
    second of planning per game) then play in parallel; the text is the same whatever the number."""
    local, envs = threading.local(), []

    def play(task: Task) -> list[str]:
        if not hasattr(local, "env"):
            local.env = taskset.make_env(expert=True)
            envs.append(local.env)
        return expert_episode_text(local.env, task, max_steps=max_steps)

    yield taskset.make_env().system_prompt
    try:
        with ThreadPoolExecutor(max(1, workers)) as pool:
            for texts in pool.map(play, taskset.tasks(split)):
                yield from texts
    finally:
        for env in envs:
            env.close()

"""Text of a task set's episodes, to learn a tokenizer on (the tiny model's BPE vocabulary).

Each task of the split is reset and, where the environment has an expert, played through with
its actions: the system prompt, every observation and every action. Only the split asked for
is read (the train split for a model that is then evaluated on held-out tasks).
"""

from __future__ import annotations

from collections.abc import Iterator

from .rollout.protocol import TaskSet


def episode_texts(taskset: TaskSet, split: str, *, max_steps: int = 50) -> Iterator[str]:
    env = taskset.make_env()
    yield env.system_prompt
    try:
        for task in taskset.tasks(split):
            yield env.reset(task)
            for _ in range(max_steps):
                action = env.expert_action()
                if action is None:
                    break
                result = env.step(action)
                yield action
                yield result.observation
                if result.done:
                    break
    finally:
        env.close()

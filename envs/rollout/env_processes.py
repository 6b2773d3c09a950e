"""Environments stepped in worker processes, so that rollouts are not paced by one Python process.

Why: on the H100 (2026-12-06) the learning bench's SGLang server held ~10 running requests while 128 episodes were
in flight: the harness process (the agent loops, the SGLang client, the trainer's Python) stepped every TextWorld
game itself, ~3.5 ms of CPU a step (Jericho's interpreter, TextWorld's quest tracking), under one process-wide lock
-- ~200 turns/s at most, whatever the GPU. ``ProcessTaskSet`` wraps any ``TaskSet``: each environment it makes lives
in one of ``processes`` worker processes (spawned, each with its own copy of the task set), and ``RemoteEnv``
forwards the protocol's calls there. The agent loop calls a remote environment from a worker thread
(``in_another_process``), which waits on the pipe without the GIL, so the workers step their games in parallel.

A worker serves its environments one call at a time (an environment's episode makes one call at a time anyway);
environments are spread over the workers by how many each holds. An environment's optional methods
(``max_new_tokens``, ``at_turn_cap``, ...) are forwarded only where the real one has them, so
``protocol.answer_budget`` and ``turn_cap_hook`` see the same environment either way.
"""

from __future__ import annotations

import multiprocessing
import threading
import traceback
from typing import Any

from .protocol import StepResult, Task, TaskSet

_OPTIONAL = ("max_new_tokens", "at_turn_cap")  # protocol hooks an environment may or may not have


def _serve(taskset: TaskSet, conn) -> None:
    """A worker: make, call and close environments as the parent asks, until it says stop."""
    envs: dict[int, Any] = {}
    while True:
        msg = conn.recv()
        if msg is None:
            break
        op, env_id, args = msg
        try:
            if op == "make":
                env = envs[env_id] = taskset.make_env(*args)
                out = (env.system_prompt, [m for m in _OPTIONAL if callable(getattr(env, m, None))])
            elif op == "close":
                env = envs.pop(env_id, None)
                out = env.close() if env is not None else None
            else:
                out = getattr(envs[env_id], op)(*args)
            conn.send((True, out))
        except BaseException as e:  # the episode's own error, raised where the call was made
            conn.send((False, (type(e).__name__, str(e), traceback.format_exc())))
    for env in envs.values():
        env.close()


class EnvProcessError(RuntimeError):
    """An environment call that raised in its worker process (the worker's traceback in the message)."""


class _Worker:
    def __init__(self, ctx, taskset: TaskSet):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(taskset, child), daemon=True)
        self.process.start()
        child.close()
        self.lock = threading.Lock()  # one call at a time on the pipe
        self.envs = 0

    def call(self, op: str, env_id: int, args: tuple = ()):
        with self.lock:
            if not self.process.is_alive():
                raise EnvProcessError(f"environment worker {self.process.pid} exited "
                                      f"(code {self.process.exitcode})")
            try:
                self.conn.send((op, env_id, args))
                ok, out = self.conn.recv()
            except (EOFError, OSError) as e:  # it died during the call (killed, out of memory)
                self.process.join(timeout=5)
                raise EnvProcessError(f"environment worker {self.process.pid} exited during {op} "
                                      f"(code {self.process.exitcode})") from e
        if not ok:
            name, message, tb = out
            raise EnvProcessError(f"{name}: {message} (in environment worker {self.process.pid})\n{tb}")
        return out

    def stop(self) -> None:
        with self.lock:
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()


class RemoteEnv:
    """An environment living in a worker process: the protocol's methods, forwarded."""

    in_another_process = True  # the agent loop calls it from a worker thread, whatever env_in_thread says

    def __init__(self, worker: _Worker, env_id: int, expert: bool):
        self._worker, self._id = worker, env_id
        self.system_prompt, self._optional = worker.call("make", env_id, (expert,))
        worker.envs += 1
        self._closed = False

    def __getattr__(self, name: str):
        if name in _OPTIONAL and name in self.__dict__.get("_optional", ()):
            return lambda *args: self._worker.call(name, self._id, args)
        raise AttributeError(name)

    def reset(self, task: Task) -> str:
        return self._worker.call("reset", self._id, (task,))

    def step(self, action: str) -> StepResult:
        return self._worker.call("step", self._id, (action,))

    def expert_action(self) -> str | None:
        return self._worker.call("expert_action", self._id)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._worker.envs -= 1
            if self._worker.process.is_alive():
                self._worker.call("close", self._id)


class ProcessTaskSet:
    """``taskset`` whose environments live in ``processes`` worker processes (see the module's docstring)."""

    def __init__(self, taskset: TaskSet, processes: int):
        if processes < 1:
            raise ValueError(f"ProcessTaskSet needs at least 1 process, got {processes}")
        self.taskset = taskset
        ctx = multiprocessing.get_context("spawn")  # the parent may hold a CUDA context: never fork it
        self.workers = [_Worker(ctx, taskset) for _ in range(processes)]
        self._ids = 0
        self._lock = threading.Lock()

    def tasks(self, split: str) -> list[Task]:
        return self.taskset.tasks(split)

    @property
    def games_version(self) -> str | None:
        return getattr(self.taskset, "games_version", None)

    def make_env(self, expert: bool = False) -> RemoteEnv:
        with self._lock:
            self._ids += 1
            worker = min(self.workers, key=lambda w: w.envs)
            return RemoteEnv(worker, self._ids, expert)

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        close = getattr(self.taskset, "close", None)
        if close is not None:
            close()

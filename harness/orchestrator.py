"""The orchestrator: an over-subscribed pool of rollout groups feeding the trainer.

Quota-based partial rollout (as in prime-rl / KV4-RL): a trainer step takes the first
``T`` complete groups of ``G`` rollouts; more groups than that keep running, and
unfinished ones carry on across weight updates (with KV streams their KV is kept, so a
rollout may mix policy versions). Off-policy lag is bounded: data used at trainer step
``n`` must come from policy versions ``>= n - async_level``; older groups are dropped
and counted. ``drain`` lets every running group finish -- a checkpoint taken at that
quiescent point resumes to exactly the data of a run never stopped, at the cost of the
drain's tail (the pool empties like a synchronous wave). ``pause`` stops them in place
instead: their engine calls in flight finish, the next ones wait for ``resume``; a
checkpoint taken there records the paused groups, which a resumed run starts again
(nothing lost or trained twice; their partial episodes are lost).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import deque
from dataclasses import dataclass, field

from envs.rollout.agent_loop import run_episode
from envs.rollout.chat import ChatRenderer
from envs.rollout.client import EngineClient
from envs.rollout.compaction import CompactionConfig
from envs.rollout.protocol import Task, TaskSet
from trainer_masks import StreamRecord

from .config import OrchestratorConfig


@dataclass
class Rollout:
    reward: float
    won: bool
    records: list[StreamRecord]
    stats: dict

    @property
    def min_version(self) -> int:
        versions = [v for r in self.records for v in r.policy_versions if v is not None]
        return min(versions) if versions else 0

    def to_dict(self) -> dict:
        return {"reward": self.reward, "won": self.won, "stats": self.stats,
                "records": [r.model_dump(mode="json") for r in self.records]}

    @classmethod
    def from_dict(cls, d: dict) -> Rollout:
        return cls(d["reward"], d["won"], [StreamRecord.model_validate(r) for r in d["records"]], d["stats"])


@dataclass
class Group:
    group_id: int
    task: Task
    rollouts: list[Rollout] = field(default_factory=list)

    @property
    def min_version(self) -> int:
        return min(r.min_version for r in self.rollouts)

    def to_dict(self) -> dict:
        return {"group_id": self.group_id, "task_id": self.task.task_id, "split": self.task.split,
                "rollouts": [r.to_dict() for r in self.rollouts]}

    @classmethod
    def from_dict(cls, d: dict) -> Group:
        return cls(d["group_id"], Task(d["task_id"], d["split"]), [Rollout.from_dict(r) for r in d["rollouts"]])


class PausableClient:
    """The episodes' view of the engine client: the calls that run the engine (``GATED``) wait while the rollouts
    are paused, so that an evaluation or a checkpoint finds the engine idle without waiting for whole episodes to
    end. Everything else goes straight to the client; the streams it opened and not yet closed are remembered
    (``abandon`` closes them)."""

    GATED = ("open", "append", "generate", "evict", "prefill")

    def __init__(self, client: EngineClient):
        self.client = client
        self.open_sids: set[int] = set()
        self._gate = asyncio.Event()
        self._gate.set()
        self._calls = 0  # gated calls past the gate, not yet returned
        self._quiet = asyncio.Event()
        self._quiet.set()

    def __getattr__(self, name: str):
        attr = getattr(self.client, name)
        return self._gated(attr) if name in self.GATED else attr

    async def ready(self) -> None:
        """Return once a call would start now: the episode times its engine calls from there (``generate_s``)."""
        while not self._gate.is_set():
            await self._gate.wait()

    def _gated(self, fn):
        async def call(*args, **kwargs):
            await self.ready()
            self._calls += 1
            self._quiet.clear()
            try:
                return await fn(*args, **kwargs)
            finally:
                self._calls -= 1
                if self._calls == 0:
                    self._quiet.set()

        return call

    async def open(self, *args, **kwargs) -> int:
        sid = await self._gated(self.client.open)(*args, **kwargs)
        self.open_sids.add(sid)
        return sid

    async def close(self, sid: int, **meta):
        self.open_sids.discard(sid)
        return await self.client.close(sid, **meta)

    @property
    def paused(self) -> bool:
        return not self._gate.is_set()

    async def pause(self) -> None:
        """Hold every gated call from now on; return once those already running have returned."""
        self._gate.clear()
        await self._quiet.wait()

    def resume(self) -> None:
        self._gate.set()


def episode_seed(run_seed: int, group_id: int, member: int) -> int:
    return (run_seed * 1_000_003 + group_id * 1009 + member) % (2**31)


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, compaction: CompactionConfig, client: EngineClient,
                 taskset: TaskSet, renderer: ChatRenderer, *, split: str = "train", seed: int = 0):
        self.config, self.compaction, self.client = config, compaction, client
        self.episode_client = PausableClient(client)  # what the episodes call: paused by ``pause``
        self.taskset, self.renderer, self.seed = taskset, renderer, seed
        self.tasks = taskset.tasks(split)
        if not self.tasks:
            raise ValueError(f"the environment has no tasks in split {split!r}")
        self.episode_config = config.episode
        self.next_group = 0
        self.relaunch: deque[int] = deque()  # groups paused at the checkpoint a run resumed from: started first
        self.completed: deque[Group] = deque()
        self.running: dict[int, asyncio.Task] = {}
        self.stale_groups = 0
        self.stale_rollouts = 0
        self._launching = True

    @property
    def target_groups(self) -> int:
        return math.ceil(self.config.groups_per_step * self.config.oversubscription)

    async def _run_group(self, group_id: int, task: Task) -> None:
        async def member(i: int) -> Rollout:
            ep = await run_episode(self.episode_client, self.taskset.make_env(), task, self.renderer, self.compaction,
                                   self.episode_config, seed=episode_seed(self.seed, group_id, i))
            return Rollout(ep.reward, ep.won, ep.records, ep.stats.as_dict())

        rollouts = await asyncio.gather(*(member(i) for i in range(self.config.group_size)))
        self.completed.append(Group(group_id, task, list(rollouts)))
        del self.running[group_id]

    def fill(self) -> None:
        while self._launching and len(self.running) + len(self.completed) < self.target_groups:
            if self.relaunch:
                gid = self.relaunch.popleft()
            else:
                gid = self.next_group
                self.next_group += 1
            task = self.tasks[gid % len(self.tasks)]
            self.running[gid] = asyncio.get_running_loop().create_task(self._run_group(gid, task))

    def _drop_stale(self, step: int) -> None:
        fresh = deque()
        for g in self.completed:
            if step - g.min_version > self.config.async_level:
                self.stale_groups += 1
                self.stale_rollouts += len(g.rollouts)
            else:
                fresh.append(g)
        self.completed = fresh

    async def batch(self, step: int) -> list[Group]:
        """The next ``T`` complete groups usable at trainer step ``step``."""
        if self.episode_client.paused:
            raise RuntimeError("batch() while the rollouts are paused: resume() first")
        while True:
            self._drop_stale(step)
            if len(self.completed) >= self.config.groups_per_step:
                return [self.completed.popleft() for _ in range(self.config.groups_per_step)]
            self.fill()
            if not self.running:
                raise RuntimeError("no rollout groups running and not enough complete ones")
            done, _ = await asyncio.wait(list(self.running.values()), return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                t.result()  # surface episode errors

    async def drain(self) -> None:
        """Stop launching, let every running group finish (paused ones resumed), resume launching."""
        self.episode_client.resume()
        self._launching = False
        while self.running:
            for t in await asyncio.gather(*list(self.running.values()), return_exceptions=True):
                if isinstance(t, BaseException):
                    raise t
        self._launching = True

    async def pause(self) -> None:
        """Stop the running groups in place: their engine calls in flight return, the next ones wait (``resume``).
        Nothing is launched meanwhile (``fill`` is the run loop's, which is the one pausing)."""
        await self.episode_client.pause()

    def resume(self) -> None:
        self.episode_client.resume()

    async def abandon(self) -> None:
        """The run is over: cancel the running groups (paused or not) and close the streams they left open."""
        tasks = list(self.running.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.running.clear()
        client = self.episode_client
        for sid in sorted(client.open_sids):
            with contextlib.suppress(Exception):  # a stream the engine dropped already: nothing left to free
                await client.close(sid)
        client.resume()

    def state_dict(self) -> dict:
        """At a drained point, or a paused one: the paused groups are recorded by id and started again by a run
        resumed from this state (``relaunch``)."""
        if self.running and not self.episode_client.paused:
            raise RuntimeError("drain() or pause() before taking the orchestrator's state")
        return {"next_group": self.next_group, "completed": [g.to_dict() for g in self.completed],
                "relaunch": [*self.relaunch, *sorted(self.running)],
                "stale_groups": self.stale_groups, "stale_rollouts": self.stale_rollouts}

    def load_state_dict(self, state: dict) -> None:
        self.next_group = state["next_group"]
        self.relaunch = deque(state.get("relaunch", []))
        self.completed = deque(Group.from_dict(g) for g in state["completed"])
        self.stale_groups, self.stale_rollouts = state["stale_groups"], state["stale_rollouts"]

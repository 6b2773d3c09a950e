"""ALFWorld players in child processes, kept and reused.

Why processes: the game engine is pure Python (grounding a game's PDDL problem takes about
a second of CPU, a step tens of milliseconds), so episodes stepped from the agent loop's
threads would take turns on one GIL; in processes they use every core, and games that run
at once share no state. Starting one (imports, the planner library) costs seconds, so a
``GamePool`` keeps them: an environment leases a process on ``reset``, hands it back on
``close``, and the pool ends them all on ``close`` or at exit.
"""

from __future__ import annotations

import argparse
import atexit
import copy
import os
import random
import re
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any


def _memoize_grammar_parser() -> None:
    """TextWorld's PDDL engine re-parses every text template (tatsu) each time it phrases an
    answer or an admissible command, about thirty times a step. The parse is a pure function
    of the template, so parse each once and hand out copies (the derivation mutates them):
    a step costs half the CPU, with byte-identical text."""
    import textworld.envs.pddl.textgen as textgen

    parse = textgen._parse_and_convert
    if getattr(parse, "memoized", False):
        return
    cache: dict = {}

    def memoized(text, rule_name, **kwargs):
        if (text, rule_name) not in cache:
            cache[text, rule_name] = parse(text, rule_name=rule_name, **kwargs)
        return copy.deepcopy(cache[text, rule_name])

    memoized.memoized = True
    textgen._parse_and_convert = memoized


# The package's expert places objects with "move X to Y" (the installed grammar) but tracks what
# it holds by looking for "put" in the last command (the release grammar's "put X in/on Y"): told
# a move as is, it believes it still holds what it placed, and loops on pick-two and put-back
# tasks (3 of a 20-game sample). It is told a move in the words it tracks.
_MOVE = re.compile(r"^move (.+) to (.+)$")


class _Player:
    """In the child: TextWorld's PDDL engine with ALFWorld's naming and the package's
    hand-coded expert. The expert is driven as ``AlfredExpert`` drives it, except that its
    failures (it gives up after ``expert_steps``) leave the game running without advice."""

    def __init__(self, expert: bool, expert_steps: int):
        import textworld
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from alfworld.agents.expert import HandCodedTWAgent
        from textworld.envs import PddlEnv

        _memoize_grammar_parser()
        infos = textworld.EnvInfos(won=True, admissible_commands=True, facts=expert, extras=["gamefile"])
        self.env = AlfredInfos(AlfredDemangler(PddlEnv(infos), shuffle=False))
        self.expert = HandCodedTWAgent(max_steps=expert_steps) if expert else None
        self.advising = False  # the expert follows this game (until it gives up)
        self.plan: list[str] = []

    def load(self, gamefile: str) -> dict:
        self.env.load(gamefile)
        state = self.env.reset()
        self.advising = self.expert is not None
        if self.advising:
            random.seed(0)  # the expert breaks ties with `random`: make its advice reproducible
            self.expert.reset(gamefile)
            self.expert.observe(state["feedback"])
            self.plan = ["look"]  # AlfredExpert's first advice: the expert learns the room from it
        return self._snapshot(state, False)

    def step(self, command: str) -> dict:
        state, _, done = self.env.step(command)
        if self.advising:
            self.plan = []
            try:
                action = self.expert.act(state, 0, state["won"], _MOVE.sub(r"put \1 in/on \2", command))
                if action in state["admissible_commands"]:
                    self.plan = [action]
            except Exception:  # HandCodedAgentTimeout / HandCodedAgentFailed: no advice from here on
                self.advising = False
        return self._snapshot(state, done)

    def _snapshot(self, state, done: bool) -> dict:
        return dict(feedback=state["feedback"], won=bool(state["won"]), done=bool(done),
                    admissible_commands=list(state["admissible_commands"] or []), expert_plan=list(self.plan))


def serve(expert: bool, expert_steps: int) -> None:
    """The child's loop: requests on stdin, answers on the stdout it was started with. Library
    prints would corrupt that channel, so from here on ``print`` goes to stderr."""
    requests = Connection(os.dup(0), writable=False)
    answers = Connection(os.dup(1), readable=False)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    player = _Player(expert, expert_steps)
    while True:
        try:
            msg = requests.recv()
        except EOFError:  # the parent is gone
            return
        if msg is None:
            return
        op, arg = msg
        try:
            answers.send(("ok", player.load(arg) if op == "load" else player.step(arg)))
        except Exception as e:
            answers.send(("error", f"{type(e).__name__}: {e}"))


class GameProcess:
    """Parent-side handle of one player process (``python -m envs.alfworld.worker``: a fresh
    interpreter, so nothing of the parent, its threads or its model, is copied in)."""

    def __init__(self, *, expert: bool = True, expert_steps: int = 200, timeout: float = 300.0):
        cmd = [sys.executable, "-m", "envs.alfworld.worker", "--expert-steps", str(expert_steps)]
        self._proc = subprocess.Popen(cmd + ([] if expert else ["--no-expert"]), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE)
        self._requests = Connection(os.dup(self._proc.stdin.fileno()), readable=False)
        self._answers = Connection(os.dup(self._proc.stdout.fileno()), writable=False)
        self._proc.stdin.close()
        self._proc.stdout.close()
        self.timeout = timeout

    def load(self, gamefile: str) -> dict[str, Any]:
        return self._call("load", str(gamefile))

    def step(self, command: str) -> dict[str, Any]:
        return self._call("step", command)

    def _call(self, op: str, arg: str) -> dict[str, Any]:
        self._requests.send((op, arg))
        if not self._answers.poll(self.timeout):
            self.close()
            raise TimeoutError(f"alfworld game process: no answer to {op!r} in {self.timeout}s")
        try:
            status, payload = self._answers.recv()
        except EOFError:
            raise RuntimeError(f"alfworld game process exited ({self._proc.wait()}) during {op!r}") from None
        if status != "ok":
            raise RuntimeError(f"alfworld game process: {payload}")
        return payload

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        if self.alive:
            try:
                self._requests.send(None)
            except OSError:
                pass
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._requests.close()
        self._answers.close()


class GamePool:
    """Idle player processes, reused across episodes. There is no cap: a lease never waits
    (waiting from the loop's threads could starve the episodes that hold processes); bound
    the number of concurrent episodes instead (``run_episodes(concurrency=...)``)."""

    def __init__(self, *, expert: bool = True, expert_steps: int = 200, timeout: float = 300.0):
        self._kwargs = dict(expert=expert, expert_steps=expert_steps, timeout=timeout)
        self._idle: list[GameProcess] = []
        self._all: list[GameProcess] = []
        self._lock = threading.Lock()
        atexit.register(self.close)

    def lease(self) -> GameProcess:
        with self._lock:
            while self._idle:
                proc = self._idle.pop()
                if proc.alive:
                    return proc
            proc = GameProcess(**self._kwargs)
            self._all.append(proc)
            return proc

    def release(self, proc: GameProcess) -> None:
        with self._lock:
            if proc.alive:
                self._idle.append(proc)
            else:
                self._all.remove(proc)

    @property
    def size(self) -> int:
        return len(self._all)

    def close(self) -> None:
        with self._lock:
            procs, self._all, self._idle = self._all, [], []
        for proc in procs:
            proc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="An ALFWorld player process (started by GameProcess).")
    parser.add_argument("--no-expert", dest="expert", action="store_false")
    parser.add_argument("--expert-steps", type=int, default=200)
    args = parser.parse_args()
    serve(args.expert, args.expert_steps)

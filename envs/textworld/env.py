"""One TextWorld game at a time, behind the environment protocol.

The story file is played by TextWorld's own player (``textworld.start``: Jericho runs the
Z-machine, the game's JSON tracks the quest). One player is kept per environment and
re-loaded on every ``reset``: starting it copies the interpreter library, loading a game
does not. Reward: ``score_weight`` times the score gained over the game's maximum, plus
``win_bonus`` on the winning step, so an episode's return is ``score/max_score`` plus the
bonus when won.
"""

from __future__ import annotations

import threading
import warnings

from envs.rollout.protocol import StepResult, Task

from .text import compact, parse_action

SYSTEM_PROMPT = (
    "You are playing a text adventure game. The first message gives your goal and where you are; "
    "each later message is the game's answer to your last command. Reply with exactly one command "
    "on one line, such as: go north, open door, take key from box, put apple on table. No other text."
)


# TextWorld (its tatsu grammar parser, Jericho) is not thread-safe, and the agent loop steps
# environments in worker threads: one game call at a time per process.
_GAME_LOCK = threading.RLock()


class TextWorldEnv:
    system_prompt = SYSTEM_PROMPT

    def __init__(self, *, max_steps: int = 100, score_weight: float = 1.0, win_bonus: float = 1.0,
                 list_commands: bool = False, expert: bool = True, system_prompt: str = SYSTEM_PROMPT):
        self.system_prompt = system_prompt
        self.max_steps, self.score_weight, self.win_bonus = max_steps, score_weight, win_bonus
        self.list_commands, self.expert = list_commands, expert
        self._player = None
        self._state = None
        self._steps = 0

    def _infos(self):
        import textworld

        return textworld.EnvInfos(score=True, max_score=True, won=True, lost=True, moves=True, objective=True,
                                  description=True, policy_commands=self.expert, admissible_commands=self.list_commands)

    def reset(self, task: Task) -> str:
        with _GAME_LOCK:
            return self._reset_unlocked(task)

    def _reset_unlocked(self, task: Task) -> str:
        import textworld

        path = task.payload["path"]
        with warnings.catch_warnings():
            # Jericho knows no generated game ("score detection disabled"); TextWorld keeps the score.
            warnings.filterwarnings("ignore", message=".*is not fully supported")
            if self._player is None:
                self._player = textworld.start(path, request_infos=self._infos())
            else:
                self._player.load(path)
            self._state = self._player.reset()
        self._steps = 0
        first = "\n".join(p for p in (self._state["objective"] or "", self._state["description"] or "") if p)
        return self._with_commands(compact(first))

    def step(self, action: str) -> StepResult:
        with _GAME_LOCK:
            return self._step_unlocked(action)

    def _step_unlocked(self, action: str) -> StepResult:
        command = parse_action(action)
        before = self._state["score"]
        self._state, _, done = self._player.step(command)
        self._steps += 1
        s = self._state
        won, lost = bool(s["won"]), bool(s["lost"])
        reward = self.score_weight * (s["score"] - before) / max(1, s["max_score"]) + (self.win_bonus if won else 0.0)
        truncated = not (won or lost) and self._steps >= self.max_steps
        info = dict(won=won, lost=lost, score=s["score"], max_score=s["max_score"], moves=s["moves"],
                    command=command, truncated=truncated)
        if self.list_commands:
            info["admissible_commands"] = list(s["admissible_commands"] or [])
        observation = compact(s.feedback)
        if not (done or truncated):
            observation = self._with_commands(observation)
        return StepResult(observation, reward, bool(done) or won or lost or truncated, info)

    def _with_commands(self, observation: str) -> str:
        if not self.list_commands:
            return observation
        return f"{observation}\nAvailable commands: {', '.join(self._state['admissible_commands'] or [])}"

    def expert_action(self) -> str | None:
        """The first command of TextWorld's plan from the current state (it re-plans after
        every step, so it recovers from detours)."""
        plan = self._state["policy_commands"] if self._state is not None and self.expert else None
        return plan[0] if plan else None

    def close(self) -> None:
        with _GAME_LOCK:
            return self._close_unlocked()

    def _close_unlocked(self) -> None:
        if self._player is not None:
            self._player.close()
        self._player, self._state = None, None

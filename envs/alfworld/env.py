"""One ALFWorld game at a time, behind the environment protocol.

The game runs in a leased player process (``worker.py``). The first message is the goal
("Your task is to: ...") followed by the room; later messages are the game's answers, as
it gives them ("Nothing happens." to a command it does not know). Reward: ``win_reward``
on the winning step, nothing otherwise (ALFWorld has no intermediate score). Episodes end
when won or after ``max_steps`` commands (the standard ALFWorld budget is 50).
"""

from __future__ import annotations

from envs.rollout.protocol import StepResult, Task
from envs.textworld.text import compact, parse_action

from .worker import GamePool, GameProcess

SYSTEM_PROMPT = (
    "You are a household robot in a text world. The first message gives your task and what you see; each "
    "later message is the world's answer to your last command. Reply with exactly one command on one line, "
    "such as: go to countertop 1, open fridge 1, take apple 1 from countertop 1, move apple 1 to fridge 1, "
    "heat apple 1 with microwave 1, clean apple 1 with sinkbasin 1, cool apple 1 with fridge 1, "
    "use desklamp 1, examine apple 1, inventory, look. No other text."
)
_BANNER = "-= Welcome to TextWorld, ALFRED! =-"


def first_message(intro: str) -> str:
    """The goal first, then the room: the game says them the other way round, after a banner."""
    body = compact(intro.replace(_BANNER, ""))
    room, sep, goal = body.partition("Your task is to:")
    return f"{sep} {goal.strip()}\n{room.strip()}" if sep else body


class AlfWorldEnv:
    system_prompt = SYSTEM_PROMPT

    def __init__(self, pool: GamePool, *, max_steps: int = 50, win_reward: float = 1.0,
                 list_commands: bool = False):
        self.pool, self.max_steps, self.win_reward, self.list_commands = pool, max_steps, win_reward, list_commands
        self._proc: GameProcess | None = None
        self._state: dict | None = None
        self._steps = 0

    def reset(self, task: Task) -> str:
        if self._proc is None:
            self._proc = self.pool.lease()
        self._state = self._proc.load(task.payload["gamefile"])
        self._steps = 0
        return self._with_commands(first_message(self._state["feedback"]))

    def step(self, action: str) -> StepResult:
        command = parse_action(action).lower()
        self._state = s = self._proc.step(command)
        self._steps += 1
        won = s["won"]
        truncated = not won and self._steps >= self.max_steps
        done = won or s["done"] or truncated
        info = dict(won=won, command=command, steps=self._steps, truncated=truncated)
        if self.list_commands:
            info["admissible_commands"] = s["admissible_commands"]
        observation = compact(s["feedback"])
        return StepResult(observation if done else self._with_commands(observation),
                          self.win_reward if won else 0.0, done, info)

    def _with_commands(self, observation: str) -> str:
        if not self.list_commands:
            return observation
        return f"{observation}\nAvailable commands: {', '.join(self._state['admissible_commands'])}"

    def admissible_commands(self) -> list[str]:
        return list(self._state["admissible_commands"]) if self._state else []

    def expert_action(self) -> str | None:
        """The package's hand-coded expert's next command (``None`` once it has given up)."""
        plan = self._state["expert_plan"] if self._state else None
        return plan[0] if plan else None

    def close(self) -> None:
        if self._proc is not None:
            self.pool.release(self._proc)
        self._proc, self._state = None, None

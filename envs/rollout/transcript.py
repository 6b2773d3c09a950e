"""An episode's game played once, then replayed: the same episode under several renderings.

SFT plays each expert episode under every compaction the runs use (``harness.sft``). The game's answers depend
only on the commands sent to it, not on how the agent loop renders the context, and the expert's commands (and
its detours, seeded per episode) are the same under every rendering. So the game is played once, through
``RecordingEnv``, and ``TranscriptEnv`` answers the other renderings from the recording: ALFWorld spends ~0.6 s
of PDDL loading and ~20 ms of planning a command per game in its player process, three times per episode before.

A replay checks every command against the recording and raises ``TranscriptMismatch`` where the loop asks for
something the recording does not hold (another command, a turn past its end: an episode cut by its token cap
under one rendering and not another); the caller then plays that rendering live. An environment whose loop reads
more than ``reset``/``step``/``expert_action`` (an answer budget, a turn-cap hook) is not replayable.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .protocol import Environment, StepResult, Task


class TranscriptMismatch(RuntimeError):
    """The replayed episode asked for something its recording does not hold."""


@dataclass
class Transcript:
    system_prompt: str = ""
    task_id: str = ""
    first: str = ""  # reset's observation
    steps: list[tuple[str, StepResult]] = field(default_factory=list)  # (command sent, the game's answer)
    expert: dict[int, str | None] = field(default_factory=dict)  # steps taken -> the expert's next command


def replayable(env: Environment) -> bool:
    """Whether the agent loop reads nothing of ``env`` but what a ``Transcript`` records."""
    return not any(callable(getattr(env, hook, None)) for hook in ("max_new_tokens", "at_turn_cap"))


class RecordingEnv:
    """``env`` played as usual, every answer kept in ``transcript``."""

    def __init__(self, env: Environment):
        if not replayable(env):
            raise ValueError(f"{type(env).__name__} has hooks a transcript does not record")
        self.env = env
        self.transcript = Transcript(env.system_prompt)

    @property
    def system_prompt(self) -> str:
        return self.env.system_prompt

    def reset(self, task: Task) -> str:
        first = self.env.reset(task)
        self.transcript = Transcript(self.env.system_prompt, task.task_id, first)
        return first

    def step(self, action: str) -> StepResult:
        result = self.env.step(action)
        self.transcript.steps.append((action, result))
        return result

    def expert_action(self) -> str | None:
        action = self.env.expert_action()
        self.transcript.expert[len(self.transcript.steps)] = action
        return action

    def close(self) -> None:
        self.env.close()


class TranscriptEnv:
    """Answers from a ``Transcript``, for the same task and the same commands, in order."""

    def __init__(self, transcript: Transcript):
        self.transcript, self.system_prompt = transcript, transcript.system_prompt
        self.taken = 0

    def reset(self, task: Task) -> str:
        if task.task_id != self.transcript.task_id:
            raise TranscriptMismatch(f"recorded task {self.transcript.task_id!r}, asked to play {task.task_id!r}")
        self.taken = 0
        return self.transcript.first

    def step(self, action: str) -> StepResult:
        steps = self.transcript.steps
        if self.taken >= len(steps):
            raise TranscriptMismatch(f"the recording ends after {len(steps)} commands; asked for one more")
        recorded, result = steps[self.taken]
        if action != recorded:
            raise TranscriptMismatch(f"command {self.taken}: recorded {recorded!r}, asked {action!r}")
        self.taken += 1
        return result

    def expert_action(self) -> str | None:
        try:
            return self.transcript.expert[self.taken]
        except KeyError:
            raise TranscriptMismatch(f"the expert was not asked after {self.taken} commands") from None

    def close(self) -> None:
        pass

"""What every compaction strategy shares: its config, what it sees, what it returns.

Eviction is by whole turns (a turn = assistant header + message + the environment's
answering message, chat tags included). The first message (system prompt and first
observation) is never evicted, nor the turn in progress. A strategy looks at the live
turns after each completed turn and, when triggered, returns the spans to evict; it may
first talk to the model (Summary, Markovian Pick) through ``Conversation.ask``, whose
exchange tokens are sampled and trained like any model tokens. The agent loop executes
the eviction in place (``kv_streams``) or by re-prefilling the kept context
(``reprefill``, the baseline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

Span = tuple[int, int]  # [start, end) stream positions
StrategyName = Literal["summary", "markovian_thinker", "markovian_pick", "sliding_window", "full_context"]


class CompactionConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    strategy: StrategyName = "sliding_window"
    execution: Literal["kv_streams", "reprefill"] = "kv_streams"
    window_turns: int = Field(10, ge=1, description="live turns that trigger the turn-window strategies (not the "
                              "episode's turn cap, orchestrator.episode.max_turns)")
    stride: int = Field(5, ge=1, description="oldest turns evicted per compaction (window strategies)")
    every_k_turns: int | None = Field(None, ge=1, description="also compact every k completed turns")
    budget: int | None = Field(None, ge=1, description="also compact when live context exceeds B tokens")
    summary_max_tokens: int = Field(256, ge=1)
    pick_max_tokens: int = Field(48, ge=1)

    @model_validator(mode="after")
    def _stride_fits(self) -> CompactionConfig:
        if self.stride > self.window_turns:
            raise ValueError(f"stride ({self.stride}) must not exceed window_turns ({self.window_turns})")
        return self


@dataclass
class EpisodeView:
    """What a strategy sees after a completed turn."""

    first_message: Span
    turns: list[Span]  # completed live turns, oldest first
    live_tokens: int  # tokens of the live context (first message + live turns + anything since)
    turns_completed: int  # completed turns so far, evicted ones included
    turn_texts: list[str] = field(default_factory=list)  # the assistant action of each live turn
    last_observation: str = ""


@dataclass
class Exchange:
    """An instruction appended as a user message and the model's sampled answer."""

    instruction: Span  # the user message
    answer: Span  # assistant header + sampled answer + end-of-turn and separator
    text: str


class Conversation(Protocol):
    async def ask(self, instruction: str, max_new_tokens: int) -> Exchange: ...

    async def restate(self, text: str) -> Span: ...

    async def flush(self) -> None: ...

    def live_ranges(self, start: int, end: int) -> list[Span]: ...


@dataclass
class Compaction:
    evict: list[Span]
    summary_tokens: int = 0
    pick_fallback: bool = False


class Strategy:
    """Base: trigger on ``every_k_turns`` / ``budget``; subclasses say what to evict."""

    name: str = "base"

    def __init__(self, config: CompactionConfig):
        self.config = config

    def triggered(self, view: EpisodeView) -> bool:
        c = self.config
        if c.every_k_turns and view.turns_completed % c.every_k_turns == 0:
            return True
        return bool(c.budget and view.live_tokens > c.budget)

    async def compact(self, view: EpisodeView, conversation: Conversation) -> Compaction:
        raise NotImplementedError

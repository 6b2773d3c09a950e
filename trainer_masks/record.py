"""`StreamRecord`: one KV stream as the sampler saw it, the unit the trainer replays.

A stream is a single token sequence in stream order (prompt, model completions,
environment observations, summaries). Token ``i`` has logical position ``i`` (positions
are never reused: evicted tokens leave gaps, they are not renumbered). Compaction is
recorded as eviction events ``(at_index, spans)``: the tokens in ``spans`` (``[start,
end)`` stream indices) stopped being visible to every token whose forward pass ran after
the eviction, i.e. to queries ``q >= at_index``. Hence ``death[k] = at_index`` of the
event that evicted ``k`` (``T``, meaning never, otherwise) and the trainer's rule: key
``k`` is visible to query ``q`` iff ``k <= q < death[k]``.

``at_index`` is the number of tokens whose KV had been computed when the eviction
happened: a sampled token whose KV is still pending is computed after the eviction, so
it must not see the evicted keys either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Source = Literal["prompt", "model", "env"]


class EvictionEvent(BaseModel):
    model_config = ConfigDict(frozen=True)

    at_index: int = Field(ge=0, description="first stream index computed after the eviction")
    spans: tuple[tuple[int, int], ...] = Field(description="evicted [start, end) stream indices")


@dataclass(frozen=True)
class Turn:
    """A maximal run of tokens from one source: ``[start, end)``."""

    source: Source
    start: int
    end: int


class StreamRecord(BaseModel):
    """Everything the trainer needs to score a stream exactly as it was sampled."""

    token_ids: list[int]
    positions: list[int]
    sources: list[Source]
    loss_mask: list[bool]
    logprobs: list[float | None] = Field(description="sampler logprob of model tokens, None elsewhere")
    policy_versions: list[int | None] = Field(description="policy version that sampled each model token")
    evictions: list[EvictionEvent] = Field(default_factory=list)
    meta: dict = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> StreamRecord:
        n = len(self.token_ids)
        for name in ("positions", "sources", "loss_mask", "logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"StreamRecord.{name} has {len(getattr(self, name))} entries for {n} tokens")
        seen: set[int] = set()
        last_at = 0
        for ev in self.evictions:
            if ev.at_index < last_at or ev.at_index > n:
                raise ValueError(f"eviction at_index {ev.at_index} is out of order or past the stream end {n}")
            last_at = ev.at_index
            for start, end in ev.spans:
                if not 0 <= start < end <= ev.at_index:
                    raise ValueError(f"evicted span [{start}, {end}) is not inside the computed prefix "
                                     f"[0, {ev.at_index})")
                overlap = seen.intersection(range(start, end))
                if overlap:
                    raise ValueError(f"stream index {min(overlap)} is evicted twice")
                seen.update(range(start, end))
        return self

    def __len__(self) -> int:
        return len(self.token_ids)

    def death(self) -> list[int]:
        """``death[k]``: first query index that no longer sees key ``k`` (``T`` = never)."""
        n = len(self.token_ids)
        death = [n] * n
        for ev in self.evictions:
            for start, end in ev.spans:
                death[start:end] = [ev.at_index] * (end - start)
        return death

    def turns(self) -> list[Turn]:
        out: list[Turn] = []
        for i, src in enumerate(self.sources):
            if out and out[-1].source == src:
                out[-1] = Turn(src, out[-1].start, i + 1)
            else:
                out.append(Turn(src, i, i + 1))
        return out

    def live_tokens_after(self, index: int) -> list[int]:
        """Stream indices visible to query ``index`` (the live context it was computed in)."""
        death = self.death()
        return [k for k in range(index + 1) if index < death[k]]

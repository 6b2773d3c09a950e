"""Markovian Pick: at the trigger, show the model the numbered turns of the band about
to be evicted (the oldest ``stride``) and let it answer which to keep, as a JSON list.
Those stay; the rest of the band and the pick exchange itself are evicted (its answer
tokens are trained, like a summary). A malformed answer falls back to Markovian
Thinker's choice (evict the whole band) and is counted."""

from __future__ import annotations

import json
import re

from .base import Compaction, EpisodeView
from .sliding_window import SlidingWindow

PREVIEW_CHARS = 80


def pick_instruction(actions: list[str]) -> str:
    lines = [f"[{i + 1}] {a[:PREVIEW_CHARS]}" for i, a in enumerate(actions)]
    return ("These earlier turns are about to be dropped from your context:\n" + "\n".join(lines)
            + "\nAnswer with a JSON list of the turn numbers to keep, e.g. [2], or [] to drop all.")


def parse_pick(text: str, band_size: int) -> list[int] | None:
    """1-based turn numbers -> 0-based band indices; None when the answer is malformed."""
    match = re.search(r"\[[^\[\]]*\]", text)
    if not match:
        return None
    try:
        values = json.loads(match.group(0))
    except json.JSONDecodeError:
        return None
    if not isinstance(values, list) or not all(isinstance(v, int) and 1 <= v <= band_size for v in values):
        return None
    return sorted({v - 1 for v in values})


class MarkovianPick(SlidingWindow):
    name = "markovian_pick"

    async def compact(self, view: EpisodeView, conversation) -> Compaction:
        band = view.turns[: min(self.config.stride, len(view.turns))]
        actions = (view.turn_texts[: len(band)] + [""] * len(band))[: len(band)]
        ex = await conversation.ask(pick_instruction(actions), self.config.pick_max_tokens)
        await conversation.flush()  # the exchange's tail must be computed before it can be evicted
        keep = parse_pick(ex.text, len(band))
        evict = band if keep is None else [t for i, t in enumerate(band) if i not in keep]
        return Compaction(evict=[*evict, ex.instruction, ex.answer], summary_tokens=ex.answer[1] - ex.answer[0],
                          pick_fallback=keep is None)

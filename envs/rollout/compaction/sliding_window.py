"""Sliding Window: keep the last ``max_turns - 1`` turns, evicting one (``stride``) turn
whenever ``max_turns`` accumulate (default stride 1; overlap o ~ B)."""

from __future__ import annotations

from .base import Compaction, EpisodeView, Strategy


class SlidingWindow(Strategy):
    name = "sliding_window"

    def triggered(self, view: EpisodeView) -> bool:
        return len(view.turns) >= self.config.max_turns or super().triggered(view)

    async def compact(self, view, conversation) -> Compaction:
        return Compaction(evict=view.turns[: min(self.config.stride, len(view.turns))])

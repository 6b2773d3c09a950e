"""Sliding Window: keep the last ``window_turns - 1`` turns, evicting one (``stride``) turn
whenever ``window_turns`` accumulate (default stride 1; overlap o ~ B)."""

from __future__ import annotations

from .base import Compaction, EpisodeView, Strategy


class SlidingWindow(Strategy):
    name = "sliding_window"

    def triggered(self, view: EpisodeView) -> bool:
        return len(view.turns) >= self.config.window_turns or super().triggered(view)

    async def compact(self, view, conversation) -> Compaction:
        return Compaction(evict=view.turns[: min(self.config.stride, len(view.turns))])

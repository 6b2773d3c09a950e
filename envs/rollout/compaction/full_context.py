"""Full context: never compact (the baseline that runs out of budget)."""

from __future__ import annotations

from .base import Compaction, Strategy


class FullContext(Strategy):
    name = "full_context"

    def triggered(self, view) -> bool:
        return False

    async def compact(self, view, conversation) -> Compaction:
        return Compaction(evict=[])

"""Summary: ask the model to summarise everything it needs, let it write the summary
(at most ``summary_max_tokens``, trained like any model tokens), then evict everything
between the first message and the summary (turns, earlier summaries, the instruction),
keeping the first message and the new summary (overlap o = 0). The
latest observation is restated after the summary so the chat alternates user/assistant."""

from __future__ import annotations

from .base import Compaction, EpisodeView, Strategy

INSTRUCTION = ("Your context is about to be cleared. Summarise everything you need to finish the task: "
               "the goal, what you have done, what you observed, and what to do next.")


class Summary(Strategy):
    name = "summary"

    def triggered(self, view: EpisodeView) -> bool:
        c = self.config
        if c.every_k_turns is None and c.budget is None:
            return len(view.turns) >= c.window_turns
        return super().triggered(view)

    async def compact(self, view, conversation) -> Compaction:
        ex = await conversation.ask(INSTRUCTION, self.config.summary_max_tokens)
        await conversation.restate(view.last_observation)
        evict = conversation.live_ranges(view.first_message[1], ex.instruction[1])
        return Compaction(evict=evict, summary_tokens=ex.answer[1] - ex.answer[0])

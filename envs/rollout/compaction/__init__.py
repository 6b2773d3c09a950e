"""Compaction strategies shared by every environment (one strategy per module)."""

from .base import Compaction, CompactionConfig, Conversation, EpisodeView, Exchange, Span, Strategy
from .full_context import FullContext
from .markovian_pick import MarkovianPick, parse_pick
from .markovian_thinker import MarkovianThinker
from .sliding_window import SlidingWindow
from .summary import Summary

STRATEGIES: dict[str, type[Strategy]] = {
    s.name: s for s in (Summary, MarkovianThinker, MarkovianPick, SlidingWindow, FullContext)
}


def make_strategy(config: CompactionConfig) -> Strategy:
    return STRATEGIES[config.strategy](config)


__all__ = ["STRATEGIES", "Compaction", "CompactionConfig", "Conversation", "EpisodeView", "Exchange",
           "FullContext", "MarkovianPick", "MarkovianThinker", "SlidingWindow", "Span", "Strategy", "Summary",
           "make_strategy", "parse_pick"]

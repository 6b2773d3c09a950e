"""Markovian Thinker: when ``window_turns`` (10) live turns accumulate, evict the oldest
``stride`` (5): the context restarts from half a window (overlap o = B/2, no summary)."""

from __future__ import annotations

from .sliding_window import SlidingWindow


class MarkovianThinker(SlidingWindow):
    """Same mechanics as the sliding window with a wide stride; kept separate so configs,
    logs and plots name the strategy the paper names."""

    name = "markovian_thinker"

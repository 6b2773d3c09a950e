"""Trainer side: replay KV streams (with their evictions) in one forward pass.

Episode -> ``StreamRecord`` (token stream, positions, death indices, loss mask) ->
attention mask (``k <= q < death[k]``) -> masked forward -> per-token logprobs.
"""

from .record import EvictionEvent, Source, StreamRecord, Turn

__all__ = ["EvictionEvent", "Source", "StreamRecord", "Turn"]

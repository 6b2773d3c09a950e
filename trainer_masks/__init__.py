"""Trainer side: replay KV streams (with their evictions) in one forward pass.

Episode -> ``StreamRecord`` (token stream, positions, death indices, loss mask) ->
attention mask (``k <= q < death[k]``) -> masked forward -> per-token logprobs.
"""

from .logprobs import StreamScores, score_packed, score_streams, stream_logprobs
from .masks import PackedBatch, dense_mask, flex_block_mask, flex_mask_mod, pack, visible
from .record import EvictionEvent, Source, StreamRecord, Turn
from .reprefill import ContextWindow, context_windows, reprefill_segments, reprefilled_tokens

__all__ = [
    "ContextWindow",
    "EvictionEvent",
    "PackedBatch",
    "Source",
    "StreamRecord",
    "StreamScores",
    "Turn",
    "context_windows",
    "dense_mask",
    "flex_block_mask",
    "flex_mask_mod",
    "pack",
    "reprefill_segments",
    "reprefilled_tokens",
    "score_packed",
    "score_streams",
    "stream_logprobs",
    "visible",
]

"""Trainer side, stream layer: replay KV streams (with their evictions) in one forward pass.

Episode -> ``StreamLedger`` (the stream's one owner while it is sampled) -> ``StreamRecord``
(token stream, positions, death indices, loss mask) -> attention mask (``k <= q < death[k]``,
dense or FlexAttention; records packed) -> ``trainer_masks.scoring`` (masked forward ->
per-token logprobs). This package depends on nothing else of the project; ``scoring`` sits a
layer above the KV4 kernels it can call.
"""

from .ledger import Eviction, EvictionError, StreamLedger, check_spans
from .masks import PackedBatch, dense_mask, flex_block_mask, flex_mask_mod, pack, visible
from .record import EvictionEvent, Source, StreamRecord, Turn
from .reprefill import ContextWindow, context_windows, reprefill_segments, reprefilled_tokens

__all__ = [
    "ContextWindow",
    "Eviction",
    "EvictionError",
    "EvictionEvent",
    "PackedBatch",
    "Source",
    "StreamLedger",
    "StreamRecord",
    "Turn",
    "context_windows",
    "dense_mask",
    "flex_block_mask",
    "flex_mask_mod",
    "pack",
    "reprefill_segments",
    "reprefilled_tokens",
    "check_spans",
    "visible",
]

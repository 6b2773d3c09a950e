"""Scoring KV streams with a causal LM: the masked forward pass and per-token logprobs.

Used by the trainer (``stream_logprobs`` / ``score_streams``) and by the built-in engine's
re-prefill under new weights (the same mask, the fp32 LM head, the batch-invariant attention).
Above the stream layer (``trainer_masks``: records, ledger, masks) and the KV4 kernels it calls.
"""

from .lm_head import decoder, fp32_logits
from .logprobs import HF_ATTENTION, Impl, StreamScores, resolve_impl, score_packed, score_streams, stream_logprobs

__all__ = ["HF_ATTENTION", "Impl", "StreamScores", "decoder", "fp32_logits", "resolve_impl", "score_packed",
           "score_streams", "stream_logprobs"]

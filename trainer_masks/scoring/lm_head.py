"""The LM head in float32, shared by the sampler (engine) and the trainer.

In bf16 the LM head's rounding is the largest single source of train/infer logprob
mismatch (MiniMax-M1 traced its RL instability to it): two kernels that round the same
bf16 hidden state differently disagree on every logit. Both sides therefore project the
final hidden states with an fp32 copy of the head weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The base model under a ``*ForCausalLM`` (its forward returns hidden states)."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def fp32_logits(model: torch.nn.Module, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``hidden [..., H]`` -> float32 logits ``[..., V]``; pass a cached fp32 ``weight`` to skip the cast."""
    head = model.get_output_embeddings()
    w = weight if weight is not None else head.weight.float()
    bias = head.bias.float() if getattr(head, "bias", None) is not None else None
    return F.linear(hidden.float(), w, bias)

"""Sampling with temperature, top-k, top-p and per-request seeds.

The returned logprob is that of the sampled token under the *tempered* model
distribution ``log_softmax(logits / T)`` before top-k/top-p truncation (at ``T = 1``
exactly the policy's logprob, which is what RL compares the trainer against; greedy
``T = 0`` reports the untempered logprob).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[int, float]:
    """One token from ``logits [V]`` (float32)."""
    logits = logits.float()
    temp = params.temperature if params.temperature > 0 else 1.0
    logp = torch.log_softmax(logits / temp, dim=-1)
    if params.temperature == 0:
        tok = int(torch.argmax(logits))
        return tok, float(logp[tok])
    filtered = logp.clone()
    if params.top_k:
        kth = torch.topk(filtered, min(params.top_k, filtered.numel())).values[-1]
        filtered[filtered < kth] = float("-inf")
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(filtered, descending=True)
        cum = torch.cumsum(sorted_lp.exp(), 0)
        drop = cum - sorted_lp.exp() >= params.top_p  # keep the smallest prefix reaching top_p
        filtered[order[drop]] = float("-inf")
    probs = torch.softmax(filtered, dim=-1)
    tok = int(torch.multinomial(probs, 1, generator=generator))
    return tok, float(logp[tok])

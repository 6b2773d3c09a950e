"""Sampling with temperature, top-k, top-p and per-request seeds, or teacher forcing.

The returned logprob is that of the sampled token under the *tempered* model
distribution ``log_softmax(logits / T)`` before top-k/top-p truncation (at ``T = 1``
exactly the policy's logprob, which is what RL compares the trainer against; greedy
``T = 0`` reports the untempered logprob). A forced token (``forced_token_ids``) is
reported the same way, so two engines can be compared on one token stream.
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
    # Teacher forcing: "sample" exactly these tokens in order, one per decode step, each reported
    # with its logprob as a sampled token would be; max_new_tokens is then len(forced_token_ids).
    forced_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "forced_token_ids", tuple(self.forced_token_ids))
        if self.forced_token_ids:
            object.__setattr__(self, "max_new_tokens", len(self.forced_token_ids))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")


def _filter(logp: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Mask a row of logprobs to its top-k / top-p set."""
    out = logp.clone()
    if params.top_k:
        kth = torch.topk(out, min(params.top_k, out.numel())).values[-1]
        out[out < kth] = float("-inf")
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(out, descending=True)
        p = sorted_lp.exp()
        drop = torch.cumsum(p, 0) - p >= params.top_p  # keep the smallest prefix reaching top_p
        out[order[drop]] = float("-inf")
    return out


def sample_batch(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 forced: list[int | None] | None = None) -> tuple[list[int], list[float]]:
    """One token per row of ``logits [B, V]``; a single device-to-host sync for the batch.

    Exponential-race sampling: ``argmax(log p - log E)`` with ``E ~ Exp(1)`` draws exactly
    from ``p``; the noise of a seeded request comes from its own generator, so a stream's
    samples do not depend on what else is in the batch. ``forced[b]``: the token row ``b``
    takes instead of drawing one (None: draw).
    """
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=logits.device)
    logp = torch.log_softmax(logits.float() / temps[:, None], dim=-1)  # [B, V]
    scores = logp
    if any(p.top_k or p.top_p < 1.0 for p in params):
        scores = torch.stack([_filter(logp[b], p) if (p.top_k or p.top_p < 1.0) else logp[b]
                              for b, p in enumerate(params)])
    noise = torch.empty_like(scores).exponential_()
    for b, g in enumerate(generators):
        if g is not None:
            noise[b].exponential_(generator=g)
    tokens = torch.argmax(scores - noise.log(), dim=-1)
    greedy = torch.tensor([p.temperature == 0 for p in params], device=logits.device)
    tokens = torch.where(greedy, torch.argmax(logits, dim=-1), tokens)
    if forced is not None and any(t is not None for t in forced):
        is_forced = torch.tensor([t is not None for t in forced], device=logits.device)
        tokens = torch.where(is_forced, torch.tensor([t or 0 for t in forced], device=logits.device), tokens)
    lps = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), lps.tolist()

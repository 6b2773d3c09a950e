"""The policy loss: GRPO advantages, truncated importance sampling, PPO clip, k3 KL.

Per token t of a rollout with advantage A (shared by all its tokens):
    w_t     = min(pi_old(t) / mu(t), C)                 truncated IS vs the sampler mu
    r_t     = pi_theta(t) / pi_old(t)                   (= 1 in value, carries the gradient)
    surr_t  = min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)
    kl_t    = exp(ref - theta) - (ref - theta) - 1      k3 estimator of KL(pi_theta || pi_ref)
    loss    = sum_t n_t (-w_t surr_t + beta kl_t)
with the token weight ``n_t`` from ``token_weights``: 1 / (loss tokens in the whole batch)
("token", DAPO) or 1 / (the rollout's loss tokens x rollouts in the batch) ("sequence", the
original GRPO). Under "token" every token of a long losing episode pulls as hard as one of a
short winning episode, so tokens every episode uses ("go", end of turn) get a net push down
that Adam turns into full-size steps; "sequence" cancels it (each rollout weighs the same).
``pi_old`` is the trainer's policy before this update, scored on the same records; the
sampler may be behind it (async) or quantised (KV4), which ``w`` corrects and the
mismatch metrics watch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def token_weights(lengths: list[int], norm: str) -> list[float]:
    """The weight of each loss token of each rollout (``lengths``: loss tokens per rollout)
    so that the batch's weights sum to 1."""
    if norm == "token":
        total = sum(lengths)
        return [1.0 / total if total else 0.0 for _ in lengths]
    if norm == "sequence":
        nonempty = sum(1 for n in lengths if n)
        return [1.0 / (n * nonempty) if n else 0.0 for n in lengths]
    raise ValueError(f"unknown loss normalisation {norm!r}; expected 'token' or 'sequence'")


def group_advantages(rewards: list[float], eps: float = 1e-6) -> list[float]:
    """GRPO: reward minus the group mean, over the group std (0 for a constant group)."""
    r = torch.tensor(rewards, dtype=torch.float64)
    std = r.std(unbiased=False)
    return ((r - r.mean()) / (std + eps)).tolist() if std > 0 else [0.0] * len(rewards)


@dataclass
class LossTerms:
    loss: torch.Tensor  # scalar, already divided by the batch's loss-token count
    sums: dict[str, float]  # metric sums over this micro-batch's loss tokens


def policy_loss(logprobs: torch.Tensor, sampler_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                advantages: torch.Tensor, weights: torch.Tensor, *, tis_cap: float, clip_eps: float,
                kl_coef: float) -> LossTerms:
    """All inputs ``[M]`` over the loss tokens of a micro-batch (``weights``: each token's
    ``n_t``, see ``token_weights``); ``logprobs`` carries grad."""
    old = logprobs.detach()
    log_w = old - sampler_logprobs
    w = torch.exp(log_w).clamp(max=tis_cap)
    ratio = torch.exp(logprobs - old)
    surr = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    d = ref_logprobs - logprobs
    kl = torch.exp(d) - d - 1
    loss = (weights * (-(w * surr) + kl_coef * kl)).sum()
    sums = {
        "mismatch_abs": float(log_w.abs().sum()),
        "mismatch_kl_k3": float((torch.exp(-log_w) - 1 + log_w).sum()),  # KL(mu || pi_old), k3 on mu's samples
        "tis_clipped": float((torch.exp(log_w) > tis_cap).sum()),
        "kl_ref": float(kl.detach().sum()),
        "tokens": float(logprobs.numel()),
    }
    return LossTerms(loss, sums)

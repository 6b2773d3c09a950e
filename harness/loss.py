"""The policy loss: GRPO advantages, truncated importance sampling, PPO clip, k3 KL.

Per token t of a rollout with advantage A (shared by all its tokens):
    w_t     = min(pi_old(t) / mu(t), C)                 truncated IS vs the sampler mu
    r_t     = pi_theta(t) / pi_old(t)                   (= 1 in value, carries the gradient)
    surr_t  = min(r_t A, clip(r_t, 1 - eps, 1 + eps) A)
    kl_t    = exp(ref - theta) - (ref - theta) - 1      k3 estimator of KL(pi_theta || pi_ref)
    loss    = sum_t (-w_t surr_t + beta kl_t) / (loss tokens in the whole batch)
``pi_old`` is the trainer's policy before this update, scored on the same records; the
sampler may be behind it (async) or quantised (KV4), which ``w`` corrects and the
mismatch metrics watch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
                advantages: torch.Tensor, *, tis_cap: float, clip_eps: float, kl_coef: float,
                total_tokens: int) -> LossTerms:
    """All inputs ``[M]`` over the loss tokens of a micro-batch; ``logprobs`` carries grad."""
    old = logprobs.detach()
    log_w = old - sampler_logprobs
    w = torch.exp(log_w).clamp(max=tis_cap)
    ratio = torch.exp(logprobs - old)
    surr = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    d = ref_logprobs - logprobs
    kl = torch.exp(d) - d - 1
    loss = (-(w * surr) + kl_coef * kl).sum() / total_tokens
    sums = {
        "mismatch_abs": float(log_w.abs().sum()),
        "mismatch_kl_k3": float((torch.exp(-log_w) - 1 + log_w).sum()),  # KL(mu || pi_old), k3 on mu's samples
        "tis_clipped": float((torch.exp(log_w) > tis_cap).sum()),
        "kl_ref": float(kl.detach().sum()),
        "tokens": float(logprobs.numel()),
    }
    return LossTerms(loss, sums)

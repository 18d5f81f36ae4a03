"""Policy-gradient loss for GRPO-style training, in torch (same math as ``backends/jax/rl_loss.py``).

Shapes: B sequences (micro-batch), T completion tokens (padded). All inputs are per token
except ``advantages`` [B].

``loss = agg( -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * KL )``
with ``ratio = exp(logp - old_logp)`` against the *rollout* log-probs, and the k3 KL
estimator to a reference policy, ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased),
which is part of the loss (not only logged) when ``beta > 0``.

Aggregation (``agg``, and ``total_tokens`` / ``total_seqs`` for exact micro-batch accumulation):
as in ``backends/jax/rl_loss.py``; the modes are listed in ``mllm_rl.rl.loss_config``.
"""

from __future__ import annotations

import torch

from mllm_rl.rl.loss_config import AGGREGATIONS, LossConfig

__all__ = ["AGGREGATIONS", "LossConfig", "policy_loss"]

Scalar = torch.Tensor | float


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    ref_logp: torch.Tensor | None = None,
    total_tokens: Scalar | None = None,
    total_seqs: Scalar | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns (scalar loss, metrics). ``logp/old_logp/ref_logp/mask``: [B, T]; ``advantages``: [B].

    Metrics (token means over this call's valid tokens, detached): ``clip_frac``, ``kl``,
    ``ratio_mean``.
    """
    mask = mask.float()
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(per_token)
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + cfg.beta * kl
    loss = _aggregate(per_token, mask, cfg, total_tokens, total_seqs)
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        metrics = {
            "clip_frac": ((unclipped != clipped).float() * mask).sum() / n,
            "kl": (kl * mask).sum() / n,
            "ratio_mean": (ratio * mask).sum() / n,
        }
    return loss, metrics


def _aggregate(
    per_token: torch.Tensor, mask: torch.Tensor, cfg: LossConfig, total_tokens: Scalar | None,
    total_seqs: Scalar | None,
) -> torch.Tensor:  # fmt: skip
    """``per_token``, ``mask``: [B, T] -> scalar (see the module docstring)."""
    if cfg.aggregation == "token_mean":
        denom = mask.sum() if total_tokens is None else torch.as_tensor(total_tokens, dtype=torch.float32)
        return (per_token * mask).sum() / denom.clamp(min=1.0)
    nseq = per_token.shape[0] if total_seqs is None else total_seqs
    if cfg.aggregation == "seq_mean_token_mean":
        seq = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    else:
        seq = (per_token * mask).sum(dim=1) / cfg.max_len
    return seq.sum() / nseq

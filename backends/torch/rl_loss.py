"""Policy-gradient loss for GRPO-style training in torch: the math of ``backends/jax/rl_loss.py``
(formula, aggregations and metrics defined in ``mllm_rl.rl.loss_config``)."""

from __future__ import annotations

import torch

from mllm_rl.rl.loss_config import AGGREGATIONS, LOG_RATIO_CLAMP, LossConfig

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
    is_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Returns (scalar loss, metrics). ``logp/old_logp/ref_logp/mask/is_weight``: [B, T];
    ``advantages``: [B]. Metrics (detached token means): ``clip_frac``, ``clip_frac_dual``, ``kl``,
    ``ratio_mean``."""
    mask = mask.float()
    ratio = torch.exp(torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv = advantages[:, None]
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = torch.maximum(loss1, loss2)
    dual = torch.zeros_like(pg, dtype=torch.bool)
    if cfg.clip_ratio_c > 0:
        loss3 = -adv * cfg.clip_ratio_c
        dual = (adv < 0) & (pg > loss3)
        pg = torch.where(adv < 0, torch.minimum(pg, loss3), pg)
    per_token = pg if is_weight is None else pg * is_weight
    kl = torch.zeros_like(per_token)
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1.0
        if cfg.kl_clamp > 0:  # k3 >= 0: verl's clamp to [-10, 10] only caps it
            kl = torch.clamp(kl, max=cfg.kl_clamp)
        per_token = per_token + cfg.beta * kl
    loss = _aggregate(per_token, mask, cfg, total_tokens, total_seqs)
    with torch.no_grad():
        n = mask.sum().clamp(min=1.0)
        metrics = {
            "clip_frac": ((loss2 > loss1).float() * mask).sum() / n,
            "clip_frac_dual": (dual.float() * mask).sum() / n,
            "kl": (kl * mask).sum() / n,
            "ratio_mean": (ratio * mask).sum() / n,
        }
    return loss, metrics


def _aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    total_tokens: Scalar | None,
    total_seqs: Scalar | None,
) -> torch.Tensor:
    """``per_token``, ``mask``: [B, T] -> scalar (see ``mllm_rl.rl.loss_config``)."""
    if cfg.aggregation == "token_mean":
        denom = mask.sum() if total_tokens is None else torch.as_tensor(total_tokens, dtype=torch.float32)
        return (per_token * mask).sum() / denom.clamp(min=1.0)
    seq = (per_token * mask).sum(dim=1)
    if cfg.aggregation == "token_sum_norm":
        return seq.sum() / cfg.max_len
    if total_seqs is not None:
        nseq = torch.as_tensor(total_seqs, dtype=torch.float32)
    elif cfg.excludes_empty:
        nseq = (mask.sum(dim=1) > 0).sum().float()
    else:
        nseq = torch.tensor(float(per_token.shape[0]))
    if cfg.aggregation == "seq_mean_token_mean":
        seq = seq / mask.sum(dim=1).clamp(min=1.0)
    elif cfg.aggregation == "dr_grpo":
        seq = seq / cfg.max_len
    return seq.sum() / nseq.clamp(min=1.0)

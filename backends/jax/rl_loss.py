"""Policy-gradient loss for GRPO-style training, in JAX (same math as ``backends/torch/rl_loss.py``).

Shapes: B sequences (micro-batch), T completion tokens (padded). The formula, aggregation modes and
metrics are defined in ``mllm_rl.rl.loss_config``. ``total_tokens`` / ``total_seqs``: the whole
mini-batch's counts, so that summing micro-batch losses equals the full-batch loss.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mllm_rl.rl.loss_config import AGGREGATIONS, LOG_RATIO_CLAMP, LossConfig

__all__ = ["AGGREGATIONS", "LossConfig", "policy_loss"]


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    cfg: LossConfig,
    ref_logp: jax.Array | None = None,
    total_tokens: jax.Array | float | None = None,
    total_seqs: jax.Array | float | None = None,
    is_weight: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns (scalar loss, metrics). ``logp/old_logp/ref_logp/mask/is_weight``: [B, T];
    ``advantages``: [B]. Metrics: ``clip_frac``, ``clip_frac_dual``, ``kl``, ``ratio_mean``."""
    mask = mask.astype(jnp.float32)
    ratio = jnp.exp(jnp.clip(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    adv = advantages[:, None]
    loss1 = -adv * ratio
    loss2 = -adv * jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = jnp.maximum(loss1, loss2)
    dual = jnp.zeros(pg.shape, bool)
    if cfg.clip_ratio_c > 0:
        loss3 = -adv * cfg.clip_ratio_c
        dual = (adv < 0) & (pg > loss3)
        pg = jnp.where(adv < 0, jnp.minimum(pg, loss3), pg)
    per_token = pg if is_weight is None else pg * is_weight
    kl = jnp.zeros_like(per_token)
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        d = ref_logp - logp
        kl = jnp.exp(d) - d - 1.0
        if cfg.kl_clamp > 0:  # k3 >= 0: verl's clamp to [-10, 10] only caps it
            kl = jnp.minimum(kl, cfg.kl_clamp)
        per_token = per_token + cfg.beta * kl
    loss = _aggregate(per_token, mask, cfg, total_tokens, total_seqs)
    n = jnp.maximum(mask.sum(), 1.0)
    metrics = {
        "clip_frac": ((loss2 > loss1) * mask).sum() / n,
        "clip_frac_dual": (dual * mask).sum() / n,
        "kl": (kl * mask).sum() / n,
        "ratio_mean": (ratio * mask).sum() / n,
    }
    return loss, metrics


def _aggregate(per_token, mask, cfg: LossConfig, total_tokens, total_seqs) -> jax.Array:
    """``per_token``, ``mask``: [B, T] -> scalar (see ``mllm_rl.rl.loss_config``)."""
    if cfg.aggregation == "token_mean":
        denom = mask.sum() if total_tokens is None else total_tokens
        return (per_token * mask).sum() / jnp.maximum(denom, 1.0)
    seq = (per_token * mask).sum(axis=1)
    if cfg.aggregation == "token_sum_norm":
        return seq.sum() / cfg.max_len
    if total_seqs is not None:
        nseq = total_seqs
    elif cfg.excludes_empty:
        nseq = (mask.sum(axis=1) > 0).sum().astype(jnp.float32)
    else:
        nseq = per_token.shape[0]
    if cfg.aggregation == "seq_mean_token_mean":
        seq = seq / jnp.maximum(mask.sum(axis=1), 1.0)
    elif cfg.aggregation == "dr_grpo":
        seq = seq / cfg.max_len
    return seq.sum() / jnp.maximum(nseq, 1.0)

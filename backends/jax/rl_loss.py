"""Policy-gradient loss for GRPO-style training, in JAX.

Shapes: B sequences (micro-batch), T completion tokens (padded). All inputs are per token
except ``advantages`` [B].

``loss = agg( -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A) + beta * KL )``
with ``ratio = exp(logp - old_logp)`` against the *rollout* log-probs, and the k3 KL
estimator to a reference policy, ``exp(ref - logp) - (ref - logp) - 1`` (>= 0, unbiased),
which is part of the loss (not only logged) when ``beta > 0``.

Aggregation (``agg``):
- ``token_mean``: sum over all valid tokens / number of valid tokens in the *whole batch*
  (pass ``total_tokens`` when accumulating micro-batches, so that summing micro-batch
  losses equals the full-batch loss);
- ``seq_mean_token_mean``: mean over sequences of each sequence's token mean
  (pass ``total_seqs`` likewise);
- ``seq_mean_token_sum_norm``: Dr. GRPO: sum of tokens / ``max_len``, mean over sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from mllm_rl.rl.loss_config import AGGREGATIONS, LossConfig

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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Returns (scalar loss, metrics). ``logp/old_logp/ref_logp/mask``: [B, T]; ``advantages``: [B]."""
    mask = mask.astype(jnp.float32)
    log_ratio = logp - old_logp
    ratio = jnp.exp(log_ratio)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv
    per_token = -jnp.minimum(unclipped, clipped)
    kl = jnp.zeros_like(per_token)
    if cfg.beta > 0:
        if ref_logp is None:
            raise ValueError("beta > 0 needs ref_logp")
        d = ref_logp - logp
        kl = jnp.exp(d) - d - 1.0
        per_token = per_token + cfg.beta * kl
    loss = _aggregate(per_token, mask, cfg, total_tokens, total_seqs)
    n = jnp.maximum(mask.sum(), 1.0)
    metrics = {
        "clip_frac": ((unclipped != clipped) * mask).sum() / n,
        "kl": (kl * mask).sum() / n,
        "ratio_mean": (ratio * mask).sum() / n,
    }
    return loss, metrics


def _aggregate(per_token, mask, cfg: LossConfig, total_tokens, total_seqs) -> jax.Array:
    if cfg.aggregation == "token_mean":
        denom = mask.sum() if total_tokens is None else total_tokens
        return (per_token * mask).sum() / jnp.maximum(denom, 1.0)
    nseq = per_token.shape[0] if total_seqs is None else total_seqs
    if cfg.aggregation == "seq_mean_token_mean":
        seq = (per_token * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
    else:
        seq = (per_token * mask).sum(axis=1) / cfg.max_len
    return seq.sum() / nseq

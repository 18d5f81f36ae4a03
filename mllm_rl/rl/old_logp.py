"""Old log-probs of the PPO ratio: the engine's, or recomputed by the trainer (verl's default), and
the engine/trainer mismatch (different kernels compute the same policy). ``old_logp="trainer"``:
the PPO ratio measures only the policy's change; ``tis_cap > 0`` (truncated importance sampling,
docs/RL.md) weighs each token by ``min(exp(logp_trainer - logp_engine), tis_cap)``. Arrays are
[B, T], valid where ``loss_mask``."""

from __future__ import annotations

import dataclasses

import numpy as np

from mllm_rl.rl.batch import RolloutBatch

SOURCES = ("trainer", "engine")


def mismatch_metrics(trainer_logp: np.ndarray, batch: RolloutBatch) -> dict[str, float]:
    """Per-token ``|logp_trainer - logp_engine|`` over the batch's completion tokens: mean and
    max, and the mean of ``exp(logp_trainer - logp_engine)`` (1 when they agree)."""
    mask = batch.loss_mask
    d = (trainer_logp.astype(np.float64) - batch.old_logp.astype(np.float64))[mask]
    if d.size == 0:
        return {"logp_mismatch_mean": 0.0, "logp_mismatch_max": 0.0, "engine_ratio_mean": 1.0}
    return {
        "logp_mismatch_mean": float(np.abs(d).mean()),
        "logp_mismatch_max": float(np.abs(d).max()),
        "engine_ratio_mean": float(np.exp(d).mean()),
    }


def with_trainer_old_logp(
    batch: RolloutBatch, trainer_logp: np.ndarray, tis_cap: float = 0.0
) -> tuple[RolloutBatch, dict[str, float]]:
    """``batch`` with the trainer's log-probs as ``old_logp`` (and, ``tis_cap > 0``, truncated
    importance weights as ``is_weight``), and the mismatch metrics (+ ``tis_capped_frac``)."""
    if trainer_logp.shape != batch.old_logp.shape:
        raise ValueError(f"trainer log-probs {trainer_logp.shape}, batch {batch.old_logp.shape}")
    mask = batch.loss_mask
    metrics = mismatch_metrics(trainer_logp, batch)
    old = np.where(mask, trainer_logp, 0.0).astype(np.float32)
    weight = batch.is_weight
    if tis_cap > 0:
        raw = np.exp(np.clip(trainer_logp.astype(np.float64) - batch.old_logp, -20.0, 20.0))
        weight = np.where(mask, np.minimum(raw, tis_cap), 1.0).astype(np.float32)
        metrics["tis_capped_frac"] = float((raw[mask] > tis_cap).mean()) if mask.any() else 0.0
    return dataclasses.replace(batch, old_logp=old, is_weight=weight), metrics

"""Old log-probs recomputed by the trainer, the engine/trainer mismatch metrics and truncated
importance sampling (``mllm_rl.rl.old_logp``), and the options that choose them."""

from __future__ import annotations

import numpy as np
import pytest

from mllm_rl.lifecycle import LifecycleOptions
from mllm_rl.option_error import OptionError
from mllm_rl.rl.batch import RolloutBatch
from mllm_rl.rl.old_logp import mismatch_metrics, with_trainer_old_logp


def engine_batch(seed: int = 0) -> tuple[RolloutBatch, np.ndarray]:
    """A [4, 6] batch with the engine's log-probs, and a trainer's that differ by noise."""
    rng = np.random.default_rng(seed)
    b, t = 4, 6
    tokens = rng.integers(1, 50, (b, t)).astype(np.int32)
    loss_mask = np.zeros((b, t), bool)
    loss_mask[:, 2:] = True
    loss_mask[3, 5] = False
    engine = np.where(loss_mask, rng.normal(-2, 0.5, (b, t)), 0).astype(np.float32)
    trainer = (engine + rng.normal(0, 0.3, (b, t))).astype(np.float32)
    batch = RolloutBatch(
        tokens, np.ones((b, t), bool), loss_mask, engine, rng.normal(size=b).astype(np.float32)
    )
    return batch, trainer


def test_mismatch_metrics_are_over_completion_tokens_only():
    batch, trainer = engine_batch()
    trainer[:, 0] = 99.0  # a prompt position: not a sampled token
    d = (trainer.astype(np.float64) - batch.old_logp)[batch.loss_mask]
    m = mismatch_metrics(trainer, batch)
    assert m["logp_mismatch_mean"] == pytest.approx(np.abs(d).mean())
    assert m["logp_mismatch_max"] == pytest.approx(np.abs(d).max()) and m["logp_mismatch_max"] < 5
    assert m["engine_ratio_mean"] == pytest.approx(np.exp(d).mean())
    same = mismatch_metrics(batch.old_logp, batch)
    assert same == {"logp_mismatch_mean": 0.0, "logp_mismatch_max": 0.0, "engine_ratio_mean": 1.0}


def test_trainer_old_logp_replace_the_engines_and_tis_weights_are_capped():
    batch, trainer = engine_batch(1)
    out, m = with_trainer_old_logp(batch, trainer)
    np.testing.assert_array_equal(out.old_logp[batch.loss_mask], trainer[batch.loss_mask])
    assert (out.old_logp[~batch.loss_mask] == 0).all() and (out.is_weight == 1).all()
    assert "tis_capped_frac" not in m and m["logp_mismatch_mean"] > 0
    out, m = with_trainer_old_logp(batch, trainer, tis_cap=1.1)
    raw = np.exp(trainer.astype(np.float64) - batch.old_logp)
    want = np.where(batch.loss_mask, np.minimum(raw, 1.1), 1.0)
    np.testing.assert_allclose(out.is_weight, want, rtol=1e-6)
    assert 0 < m["tis_capped_frac"] < 1
    assert m["tis_capped_frac"] == pytest.approx((raw[batch.loss_mask] > 1.1).mean())
    np.testing.assert_array_equal(batch.is_weight, 1.0)  # the input batch is not changed


def test_options_refuse_tis_without_trainer_old_logp_and_unknown_sources():
    assert LifecycleOptions().old_logp == "trainer"  # verl's default: recompute with the trainer
    with pytest.raises(OptionError, match="tis_cap"):
        LifecycleOptions(old_logp="engine", tis_cap=2.0)
    with pytest.raises(OptionError, match="old_logp"):
        LifecycleOptions(old_logp="rollout")
    with pytest.raises(OptionError, match="tis_cap"):
        LifecycleOptions(tis_cap=float("nan"))

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mllm_rl.backends.jax.rl_loss import AGGREGATIONS, LossConfig, policy_loss
from mllm_rl.backends.jax.trainer import JaxTrainer
from mllm_rl.checkpoint import ModelDir
from mllm_rl.rl.loss_config import EMPTY_SEQS, seq_count
from mllm_rl.trainer import RolloutBatch, TrainConfig
from tests import rl_reference as ref_defs


def batch(seed=0, b=4, t=6):
    rng = np.random.default_rng(seed)
    logp = jnp.asarray(rng.normal(-2, 0.3, (b, t)), jnp.float32)
    old = logp + jnp.asarray(rng.normal(0, 0.3, (b, t)), jnp.float32)
    ref = logp + jnp.asarray(rng.normal(0, 0.2, (b, t)), jnp.float32)
    adv = jnp.asarray(rng.normal(0, 1, (b,)), jnp.float32)
    mask = jnp.asarray(np.arange(t)[None, :] < rng.integers(2, t + 1, (b, 1)), jnp.float32)
    return logp, old, ref, adv, mask


def test_on_policy_unclipped_loss_is_minus_mean_advantage():
    logp, _, _, adv, mask = batch()
    loss, m = policy_loss(logp, logp, adv, mask, LossConfig())
    want = -(adv[:, None] * mask).sum() / mask.sum()
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    assert m["clip_frac"] == 0


def test_asymmetric_clipping():
    adv = jnp.ones((1,))
    mask = jnp.ones((1, 1))
    old = jnp.zeros((1, 1))
    high = jnp.log(jnp.full((1, 1), 1.5))  # ratio 1.5 > 1 + eps_high
    loss, _ = policy_loss(high, old, adv, mask, LossConfig(eps_low=0.2, eps_high=0.28))
    np.testing.assert_allclose(loss, -1.28, rtol=1e-6)
    loss, _ = policy_loss(high, old, -adv, mask, LossConfig(eps_low=0.2, eps_high=0.28))
    np.testing.assert_allclose(loss, 1.5, rtol=1e-6)  # negative advantage: unclipped side is the min


def test_kl_is_in_the_loss_and_its_gradient():
    logp, old, ref, adv, mask = batch(1)
    f = lambda lp, beta: policy_loss(lp, old, adv, mask, LossConfig(beta=beta), ref_logp=ref)[0]  # noqa: E731
    assert f(logp, 0.1) > f(logp, 0.0)
    g0, g1 = jax.grad(f)(logp, 0.0), jax.grad(f)(logp, 0.1)
    assert not np.allclose(g0, g1)  # the KL term changes the update, not only a logged metric
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, adv, mask, LossConfig(beta=0.1))


@pytest.mark.parametrize("empty", EMPTY_SEQS)
@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_micro_batch_accumulation_equals_full_batch(agg, empty):
    logp, old, ref, adv, mask = batch(2, b=6)
    mask = mask.at[1].set(0.0)  # an aborted completion in the first micro-batch
    cfg = LossConfig(aggregation=agg, beta=0.05, max_len=6, empty_seqs=empty)
    f = lambda lp, o, r, a, m, **kw: policy_loss(lp, o, a, m, cfg, ref_logp=r, **kw)[0]  # noqa: E731
    full_loss, full_grad = jax.value_and_grad(f)(logp, old, ref, adv, mask)
    totals = {"total_tokens": mask.sum(), "total_seqs": seq_count(np.asarray(mask), cfg)}
    acc_loss, acc_grad = 0.0, []
    for s in (slice(0, 2), slice(2, 6)):
        lv, g = jax.value_and_grad(f)(logp[s], old[s], ref[s], adv[s], mask[s], **totals)
        acc_loss += lv
        acc_grad.append(g)
    np.testing.assert_allclose(acc_loss, full_loss, rtol=1e-5)
    np.testing.assert_allclose(jnp.concatenate(acc_grad), full_grad, rtol=1e-5, atol=1e-7)


def test_a_token_past_the_kl_clamp_gets_no_kl_gradient():
    """verl's ``low_var_kl`` clamps k3 at 10: the loss of a token past it is beta * 10 and its KL
    gradient is 0; ``kl_clamp=0`` keeps TRL's unclamped k3 and its gradient."""
    logp, old, mask, adv = jnp.zeros((1, 1)), jnp.zeros((1, 1)), jnp.ones((1, 1)), jnp.zeros((1,))
    ref = jnp.full((1, 1), 3.0)  # k3 = e^3 - 3 - 1 = 16.1
    f = lambda lp, c: policy_loss(lp, old, adv, mask, LossConfig(beta=0.5, kl_clamp=c), ref_logp=ref)[0]  # noqa: E731
    np.testing.assert_allclose(f(logp, 10.0), 0.5 * 10.0, rtol=1e-6)
    assert float(jax.grad(f)(logp, 10.0)[0, 0]) == 0.0
    np.testing.assert_allclose(f(logp, 0.0), 0.5 * (np.exp(3.0) - 4.0), rtol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(logp, 0.0)[0, 0], 0.5 * (1.0 - np.exp(3.0)), rtol=1e-6)


def batch_with_aborted_row(b: int = 5) -> tuple[RolloutBatch, RolloutBatch]:
    """``b`` completions of the tiny model's vocabulary, and the same with one more row: row 0's
    tokens, aborted (no loss token, advantage 0)."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, 300, (b, 12)).astype(np.int32)
    attn = np.ones(tokens.shape, bool)
    loss_mask = attn & (np.arange(12)[None, :] >= rng.integers(3, 8, (b, 1)))
    old = np.where(loss_mask, rng.normal(-5.9, 0.3, tokens.shape), 0).astype(np.float32)
    plain = RolloutBatch(tokens, attn, loss_mask, old, rng.normal(0, 1, b).astype(np.float32))
    aborted = RolloutBatch(
        np.concatenate([tokens, tokens[:1]]), np.concatenate([attn, attn[:1]]),
        np.concatenate([loss_mask, np.zeros_like(loss_mask[:1])]), np.concatenate([old, np.zeros_like(old[:1])]),
        np.append(plain.advantages, np.float32(0.0)),
    )  # fmt: skip
    return plain, aborted


@pytest.mark.parametrize("empty,scale", [("exclude", 1.0), ("count", 5 / 6)])
def test_an_aborted_completion_counts_in_the_sequence_mean_as_the_option_says(tiny_ckpt, empty, scale):
    """The trainer's sequence count (``seq_count``) follows ``--loss-empty-seqs``: an aborted
    completion leaves the loss of 5 completions as it was (verl) or scales it by 5/6 (TRL)."""
    loss = LossConfig(aggregation="seq_mean_token_mean", empty_seqs=empty)
    cfg = TrainConfig(micro_batch_size=2, loss=loss)
    plain, aborted = batch_with_aborted_row()
    losses = [JaxTrainer(ModelDir.open(tiny_ckpt), cfg).train_step(b)["loss"] for b in (plain, aborted)]
    assert losses[1] == pytest.approx(losses[0] * scale, rel=1e-5)


# -- docs/RL.md's table: each quantity against verl's and TRL's definitions (tests/rl_reference.py)
def ours(cfg: dict, d: dict, is_weight=None) -> dict[str, float]:
    loss, m = policy_loss(jnp.asarray(d["logp"]), jnp.asarray(d["old"]), jnp.asarray(d["adv"]),
                          jnp.asarray(d["mask"]), LossConfig(**cfg), ref_logp=jnp.asarray(d["ref"]),
                          is_weight=None if is_weight is None else jnp.asarray(is_weight))  # fmt: skip
    return {"loss": float(loss), **{k: float(v) for k, v in m.items()}}


def test_every_row_of_the_rl_table_matches_verl_and_trl():
    assert ref_defs.check_table(ours) >= 20


def test_where_verl_and_trl_differ_the_table_tells_them_apart():
    ref_defs.check_choices(ours)


def test_a_batch_of_aborted_completions_has_loss_zero():
    ref_defs.check_all_empty(ours)


def test_clip_frac_counts_tokens_whose_gradient_the_clip_cuts():
    ref_defs.check_clip_frac_is_not_the_out_of_range_share(ours)


def test_truncated_importance_sampling_matches_verl():
    ref_defs.check_tis(ours)


def test_dual_clip_bounds_the_loss_of_a_huge_ratio_with_negative_advantage():
    old, mask, adv = jnp.zeros((1, 1)), jnp.ones((1, 1)), -jnp.ones((1,))
    huge = jnp.full((1, 1), 5.0)  # ratio e^5 = 148
    loss, m = policy_loss(huge, old, adv, mask, LossConfig(clip_ratio_c=3.0))
    np.testing.assert_allclose(loss, 3.0, rtol=1e-6)
    assert float(m["clip_frac_dual"]) == 1.0
    loss, _ = policy_loss(huge, old, adv, mask, LossConfig(clip_ratio_c=0.0))
    np.testing.assert_allclose(loss, np.exp(5.0), rtol=1e-5)

import numpy as np
import pytest

from mllm_rl.rl import group_advantages
from tests import rl_reference as ref_defs


def test_grpo_normalises_within_each_group():
    r = np.array([1, 0, 0, 1, 5, 5, 5, 9], np.float32)
    adv = group_advantages(r, 4, "grpo", std="biased").reshape(2, 4)
    np.testing.assert_allclose(adv.mean(axis=1), 0, atol=1e-6)
    np.testing.assert_allclose(adv[0], [1, -1, -1, 1], atol=1e-5)
    assert adv[1, 3] > 0 and np.allclose(adv[1, :3], adv[1, 0])


@pytest.mark.parametrize("g", [2, 8])
def test_grpo_default_std_is_verl_and_trl_unbiased_std(g):
    r = np.random.default_rng(g).integers(0, 3, 4 * g).astype(np.float64)
    r[:g] = np.arange(g)  # one group surely not constant
    ours = group_advantages(r, g, "grpo")
    np.testing.assert_allclose(ours, ref_defs.verl_grpo_advantages(r, g), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ours, ref_defs.trl_advantages(r, g), rtol=2e-4, atol=1e-4)  # TRL's eps is 1e-4
    biased = group_advantages(r, g, "grpo", std="biased")
    nz = np.abs(ours) > 1e-3
    np.testing.assert_allclose(
        biased[nz] / ours[nz], np.sqrt(g / (g - 1)), rtol=1e-4
    )  # x1.414 at 2, x1.069 at 8


def test_equal_rewards_give_zero_advantage_not_nan():
    adv = group_advantages(np.ones(6), 3, "grpo")
    assert np.all(adv == 0)


def test_drgrpo_has_no_std_scaling():
    adv = group_advantages(np.array([0, 10, 0, 2.0]), 2, "drgrpo")
    np.testing.assert_allclose(adv, [-5, 5, -1, 1])


def test_rloo_uses_leave_one_out_baseline():
    r = np.array([1.0, 2.0, 6.0])
    adv = group_advantages(r, 3, "rloo")
    np.testing.assert_allclose(adv, [1 - 4, 2 - 3.5, 6 - 1.5], rtol=1e-6)


@pytest.mark.parametrize(
    "kw,msg", [({"group_size": 4}, "groups of 4"), ({"group_size": 3, "estimator": "ppo"}, "estimator")]
)
def test_bad_input_is_rejected(kw, msg):
    with pytest.raises(ValueError, match=msg):
        group_advantages(np.zeros(6), **kw)

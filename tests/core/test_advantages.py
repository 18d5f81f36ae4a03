import numpy as np
import pytest

from mllm_rl.rl import group_advantages


def test_grpo_normalises_within_each_group():
    r = np.array([1, 0, 0, 1, 5, 5, 5, 9], np.float32)
    adv = group_advantages(r, 4, "grpo").reshape(2, 4)
    np.testing.assert_allclose(adv.mean(axis=1), 0, atol=1e-6)
    np.testing.assert_allclose(adv[0], [1, -1, -1, 1], atol=1e-5)
    assert adv[1, 3] > 0 and np.allclose(adv[1, :3], adv[1, 0])


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

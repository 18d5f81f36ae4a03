"""Rollouts -> training batch, and the shipped tasks' prompts and rewards."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mllm_rl.engine import GenerateOutput
from mllm_rl.rl.batch import build_batch
from mllm_rl.tasks import get_task
from mllm_rl.tasks.boxed import boxed_reward, last_boxed, target_of
from mllm_rl.tasks.pattern import PatternTask


def out(tokens, finish="length"):
    return GenerateOutput(list(tokens), [-0.5 - 0.1 * i for i in range(len(tokens))], "", finish)


def test_batch_aligns_completion_tokens_and_their_logprobs():
    prompts = [[5, 6, 7], [8]]
    outs = [out([1, 2]), out([3, 4, 9])]
    b = build_batch(prompts, outs, np.array([1.0, -1.0]))
    assert b.tokens.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 9, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # position t is predicted from t-1: the mask marks the completion tokens themselves
    assert b.loss_mask.tolist() == [[0, 0, 0, 1, 1], [0, 1, 1, 1, 0]]
    np.testing.assert_allclose(b.old_logp[0, 3:], [-0.5, -0.6])
    np.testing.assert_allclose(b.old_logp[1, 1:4], [-0.5, -0.6, -0.7])
    assert b.old_logp[~b.loss_mask].sum() == 0
    assert b.advantages.tolist() == [1.0, -1.0]


def test_aborted_completion_is_kept_but_never_trained_on():
    b = build_batch([[5, 6], [7]], [out([1], "abort"), out([2, 3])], np.array([2.0, -2.0]))
    assert not b.loss_mask[0].any() and b.advantages[0] == 0
    assert b.attention_mask[0].tolist() == [1, 1, 1]
    assert b.loss_mask[1].sum() == 2


def test_batch_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="2 prompts, 1 outputs"):
        build_batch([[1], [2]], [out([1])], np.zeros(2))
    bad = GenerateOutput([1, 2], [0.0], "", "length")
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        build_batch([[1]], [bad], np.zeros(1))


def test_pattern_task_is_deterministic_periodic_and_partially_credited():
    task = PatternTask()
    a = task.sample(np.random.default_rng([0, 3, 0]), 64)
    b = task.sample(np.random.default_rng([0, 3, 0]), 64)
    assert a == b
    for ex in a:
        full = ex.prompt + ex.answer
        period = next(p for p in task.periods if all(full[i] == full[i % p] for i in range(len(full))))
        assert period in task.periods and len(ex.answer) == task.answer_len
        assert set(full) <= set(task.alphabet)
    ex = a[0]
    assert task.reward(ex.answer, ex) == 1.0
    assert task.reward(ex.answer[:2] + "zz", ex) == 0.5
    assert task.reward("", ex) == 0.0


@pytest.mark.parametrize(
    "text,answer,want",
    [
        ("so \\boxed{72}", "18*4 = 72\n#### 72", 1.0),
        ("\\boxed{1} then \\boxed{ 1,200 }", "#### 1200", 1.0),
        ("\\boxed{3.0}", "3", 1.0),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0),
        ("72", "#### 72", 0.0),
        ("\\boxed{71}", "#### 72", 0.0),
        ("\\boxed{72", "#### 72", 0.0),
    ],
)
def test_boxed_reward(text, answer, want):
    assert boxed_reward(text, answer) == want


def test_boxed_helpers():
    assert last_boxed("a \\boxed{x{y}} b \\boxed{z}") == "z"
    assert last_boxed("no box") is None
    assert target_of("work\n#### $1,000") == "1000"


def test_boxed_task_loads_the_shipped_sample_and_rejects_bad_files(tmp_path):
    task = get_task("boxed")
    assert len(task.examples) >= 20
    ex = task.examples[0]
    assert boxed_reward(f"\\boxed{{{target_of(ex.answer)}}}", ex.answer) == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "#### 1"}) + "\n{not json\n")
    with pytest.raises(ValueError, match=f"{bad}:2: expected a JSON object"):
        get_task("boxed", str(bad))
    with pytest.raises(ValueError, match="not a file"):
        get_task("boxed", str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="--task 'chess'"):
        get_task("chess")


def test_request_seeds_differ_per_request_and_repeat_per_batch_seed():
    from mllm_rl.engine import request_seeds

    seeds = request_seeds(7, 64)
    assert len(set(seeds)) == 64 and all(0 <= s < 2**31 for s in seeds)
    assert request_seeds(7, 64) == seeds and set(request_seeds(8, 64)).isdisjoint(seeds)


def test_train_metrics_are_per_token_means_of_the_step_sums():
    from mllm_rl.trainer import TRAIN_METRICS, train_metrics

    totals = {
        "tokens": 40.0,
        "clip_frac": 10.0,
        "clip_frac_dual": 4.0,
        "kl": 2.0,
        "ratio_mean": 41.0,
        "entropy_proxy": 120.0,
    }
    m = train_metrics(loss_sum=3.0, n_parts=4, grad_norms=[1.0, 3.0], totals=totals, seconds=1.23456)
    assert list(m) == list(TRAIN_METRICS)
    assert m == {"loss": 0.75, "grad_norm": 2.0, "clip_frac": 0.25, "clip_frac_dual": 0.1, "kl": 0.05,
                 "ratio_mean": 1.025,
                 "neg_logp_mean": 3.0, "tokens": 40, "updates": 2, "train_s": 1.2346}  # fmt: skip
    empty = train_metrics(0.0, 0, [], {}, 0.0)  # no valid token: zeros, no division by zero
    assert empty["grad_norm"] == 0.0 and empty["kl"] == 0.0 and empty["tokens"] == 0 and empty["updates"] == 0

"""Bring your own task on JAX CPU (sglang-jax engine, flax trainer): a user's JSONL file and a reward
passed by file path reach every phase that scores (the reward's rise on them: tests/torch/test_byo_task.py;
the JAX trainer's on the same task: tests/jax/test_rl_run.py's embedded default); a reward that hangs
ends the run with one clear line (``tests/byo_task.py``). A --tasks file's task with the user's data and reward file:
tests/core/test_multitask_fake_run.py (fake backend) and tests/torch/test_byo_task.py."""

from __future__ import annotations

import pytest

from tests.byo_task import bad_reward_is_a_clear_exit, run_learns_from_a_jsonl_and_a_reward_file

pytestmark = pytest.mark.slow  # every test here starts an engine


def test_a_user_jsonl_and_reward_file_score_every_rollout_and_evaluation(tmp_path):
    run_learns_from_a_jsonl_and_a_reward_file("jax", tmp_path, learns=False)


def test_a_bad_reward_is_a_clear_exit_1(tmp_path):
    """A reward past its timeout: the worker killed under sglang-jax's SIGCHLD reaper (the other failures: tests/core/test_tasks_reward.py)."""
    bad_reward_is_a_clear_exit("jax", tmp_path, "hangs")

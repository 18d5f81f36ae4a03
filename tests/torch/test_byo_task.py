"""Bring your own task on the torch backend (embedded engine, torch trainer, CPU): the checks of the
JAX run (``tests/byo_task.py``) over 8 steps, and the reward's rise on the user's data and reward file."""

from __future__ import annotations

import pytest

from tests.byo_task import (
    bad_reward_is_a_clear_exit,
    run_learns_from_a_jsonl_and_a_reward_file,
    tasks_file_takes_a_dataset_and_a_reward_file,
)

pytestmark = pytest.mark.slow  # every test here starts an engine


def test_reward_rises_on_a_user_jsonl_with_a_reward_file(tmp_path):
    run_learns_from_a_jsonl_and_a_reward_file("torch", tmp_path)


def test_a_bad_reward_is_a_clear_exit_1(tmp_path):
    """A reward a value the run refuses (the other failures: tests/core/test_tasks_reward.py)."""
    bad_reward_is_a_clear_exit("torch", tmp_path, "nan")


def test_a_tasks_file_task_takes_a_dataset_and_a_reward_file(tmp_path):
    tasks_file_takes_a_dataset_and_a_reward_file("torch", tmp_path)

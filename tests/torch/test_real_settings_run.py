"""Whole runs at real settings, on real engines: the trainer's log-probs are of the distribution the engine
sampled (logits / T), and a bf16 checkpoint learns at a fine-tuning learning rate."""

from __future__ import annotations

import pytest

from tests.rl_runs import check_bf16_checkpoint_learns_at_fine_tuning_lr, check_temperature_consistent


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_step0_trainer_logprobs_match_the_engines_at_temperature(temperature, tiny_ckpt, tmp_path):
    check_temperature_consistent("torch", tiny_ckpt, temperature, tmp_path / "run")


@pytest.mark.slow
def test_bf16_checkpoint_learns_at_a_fine_tuning_lr_with_mixed_precision(tmp_path):
    check_bf16_checkpoint_learns_at_fine_tuning_lr("torch", tmp_path / "precision.json", seed=1)

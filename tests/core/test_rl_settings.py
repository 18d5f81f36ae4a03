"""The RL plan's options at real settings: the learning rate follows the model (from scratch for
``tiny``, fine-tuning for a pretrained checkpoint), the trainer's log-probs use the rollout's
temperature, mixed precision is the default, and each reaches the trainer's config."""

from __future__ import annotations

import types

import numpy as np
import pytest

from mllm_rl.option_error import OptionError
from mllm_rl.plans.preflight import build_options
from mllm_rl.plans.rl import FINE_TUNE_LR, FROM_SCRATCH_LR, PLAN, checkpoint_meta
from mllm_rl.rl.loss_config import LossConfig, seq_count
from mllm_rl.run import build_parser, parse_args


def options(*flags: str):
    return build_options(parse_args(["--backend", "jax", *flags])[0])


def model(name: str):
    """What ``with_model`` reads of a ``ModelDir``: its config's preset name and context length, and
    its tokenizer (the prompts must fit the context: the shipped tokenizer)."""
    from mllm_rl.checkpoint.make import TOKENIZER_DIR

    config = types.SimpleNamespace(name=name, max_position_embeddings=1024)
    return types.SimpleNamespace(config=config, path=TOKENIZER_DIR)


@pytest.mark.parametrize(
    "name,lr", [("tiny", FROM_SCRATCH_LR), ("qwen3-4b", FINE_TUNE_LR), ("Qwen3-8B", 1e-6)]
)
def test_an_unset_lr_is_the_models_default(name, lr):
    opts, _ = PLAN.with_model(options(), model(name))
    assert opts.train.lr == lr and not opts.lr_from_model


def test_a_given_lr_is_kept_for_every_model():
    opts, _ = PLAN.with_model(options("--lr", "3e-3"), model("qwen3-4b"))
    assert opts.train.lr == 3e-3


def test_temperature_precision_and_rl_math_reach_the_trainer_and_the_lifecycle():
    opts = options("--temperature", "0.7", "--precision", "pure", "--clip-ratio-c", "0", "--adv-std", "biased",
                   "--old-logp", "engine", "--loss-agg", "dr_grpo")  # fmt: skip
    assert opts.train.temperature == opts.temperature == 0.7
    assert opts.train.precision == "pure" and opts.train.loss.clip_ratio_c == 0
    assert opts.train.loss.aggregation == "dr_grpo" and opts.adv_std == "biased"
    assert opts.lifecycle.old_logp == "engine" and opts.lifecycle.tis_cap == 0
    default = options()
    assert default.train.precision == "mixed" and default.train.loss.clip_ratio_c == 3.0
    assert default.lifecycle.old_logp == "trainer" and default.adv_std == "unbiased"
    # a resume must load masters written at the same precision
    assert checkpoint_meta("jax", default)["precision"] == "mixed"


def test_the_verl_and_trl_loss_choices_reach_the_loss():
    """verl's definitions are the defaults (k3 capped at 10, sequences without a valid token left out
    of the sequence means); TRL's are one flag away; verl's seq-mean-token-sum-norm is its own choice."""
    default = options().train.loss
    assert default.kl_clamp == 10.0 and default.empty_seqs == "exclude"
    loss = options("--kl-clamp", "0", "--loss-empty-seqs", "count", "--loss-agg", "token_sum_norm",
                   "--max-new-tokens", "12").train.loss  # fmt: skip
    assert (loss.kl_clamp, loss.empty_seqs) == (0.0, "count")
    assert (loss.aggregation, loss.max_len) == ("token_sum_norm", 12)


@pytest.mark.parametrize(
    "kw,field",
    [({"aggregation": "token_sum_norm"}, "max_len"), ({"kl_clamp": float("nan")}, "kl_clamp"),
     ({"empty_seqs": "drop"}, "loss_empty_seqs")],
)  # fmt: skip
def test_a_bad_loss_setting_names_its_field(kw, field):
    with pytest.raises(OptionError) as e:
        LossConfig(**kw)
    assert e.value.field == field


def test_the_old_aggregation_name_says_both_of_its_successors():
    with pytest.raises(OptionError, match="'dr_grpo'.*'token_sum_norm'"):
        LossConfig(aggregation="seq_mean_token_sum_norm", max_len=4)


@pytest.mark.parametrize(
    "agg,empty,want",
    [("seq_mean_token_mean", "exclude", 2.0), ("seq_mean_token_sum", "exclude", 2.0),
     ("seq_mean_token_mean", "count", 4.0), ("dr_grpo", "exclude", 4.0), ("token_mean", "exclude", 4.0)],
)  # fmt: skip
def test_the_sequences_a_mean_divides_by(agg, empty, want):
    """Only the sequence means with ``exclude`` leave out a row without a valid token; dr_grpo
    divides by every sequence (TRL's B * max_completion_length)."""
    mask = np.array([[1, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0]], bool)
    assert seq_count(mask, LossConfig(aggregation=agg, empty_seqs=empty, max_len=3)) == want


def test_help_says_how_the_default_lr_is_chosen():
    text = build_parser().format_help()
    assert "1e-6 for every other model" in " ".join(text.split())

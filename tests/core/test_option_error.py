"""Options dataclasses name their fields; the CLI spells a field as its flag, a tasks file as its key."""

from __future__ import annotations

import pytest

from mllm_rl.engine import EngineOptions, SamplingParams
from mllm_rl.lifecycle import LifecycleOptions
from mllm_rl.multitask.spec import FIELDS
from mllm_rl.option_error import OptionError, cli_flag, cli_key
from mllm_rl.plans.preflight import build_options
from mllm_rl.plans.rl import RLOptions
from mllm_rl.plans.swap import SwapOptions
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.run import build_parser, parse_args
from mllm_rl.trainer import TrainConfig

BAD = [
    (RLOptions, {"steps": 0}, "steps"),
    (RLOptions, {"group_size": 1}, "group_size"),
    (RLOptions, {"estimator": "ppo"}, "estimator"),
    (RLOptions, {"checkpoint_every": -1}, "checkpoint_every"),
    (SwapOptions, {"mode": "eager"}, "swap_mode"),
    (EngineOptions, {"context_length": 0}, "context_length"),
    (EngineOptions, {"chunk_bytes": -1}, "chunk_bytes"),
    (SamplingParams, {"top_p": 0.0}, "top_p"),
    (LifecycleOptions, {"schedule": "eager"}, "schedule"),
    (TrainConfig, {"lr": -1.0}, "lr"),
    (TrainConfig, {"micro_batch_size": 0}, "micro_batch_size"),
    (LossConfig, {"beta": -0.1}, "kl_beta"),
    (LossConfig, {"aggregation": "sum"}, "loss_agg"),
    (LossConfig, {"kl_clamp": -1.0}, "kl_clamp"),
    (LossConfig, {"empty_seqs": "skip"}, "loss_empty_seqs"),
]


@pytest.mark.parametrize("cls,kw,field", BAD, ids=[f"{c.__name__}.{f}" for c, _, f in BAD])
def test_an_invalid_option_names_its_field_and_the_cli_has_a_flag_for_it(cls, kw, field):
    with pytest.raises(OptionError) as e:
        cls(**kw)
    assert e.value.field == field and str(e.value) == f"{field} {e.value.problem}"
    assert not str(e.value).startswith("-")
    flags = {s for a in build_parser()._actions for s in a.option_strings}
    assert cli_flag(field) in flags


def test_every_field_with_a_flag_of_another_name_is_an_option_key():
    for field in ("beta", "aggregation", "empty_seqs"):
        with pytest.raises(OptionError) as e:
            LossConfig(**{field: -1.0 if field == "beta" else "x"})
        assert e.value.field != field and cli_key(e.value.field) in FIELDS


def test_the_cli_says_the_flag_the_user_typed():
    args, _ = parse_args(["--backend", "jax", "--group-size", "1"])
    with pytest.raises(ValueError, match=r"^--group-size 1: group-relative advantages need >= 2") as e:
        build_options(args)
    assert not isinstance(e.value, OptionError)

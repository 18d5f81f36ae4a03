"""The options dataclasses are one tree over the schema: each field bound to an option takes its
default and its check from there, every rl option reaches a field, and ``from_args`` fills them."""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

import pytest

from mllm_rl.engine import EngineOptions
from mllm_rl.lifecycle import LifecycleOptions
from mllm_rl.option_error import OptionError, cli_flag
from mllm_rl.options.check import GIVEN, OPTION, OWN_DEFAULT, bound, check_fields, check_range, from_args, opt
from mllm_rl.options.schema import BY_KEY, FROM_SCRATCH_LR, defaults, in_scope
from mllm_rl.plans.preflight import build_options
from mllm_rl.plans.rl import RLOptions
from mllm_rl.plans.swap import SwapOptions
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.run import parse_args
from mllm_rl.trainer import TrainConfig

CLASSES = (RLOptions, TrainConfig, LossConfig, LifecycleOptions, EngineOptions, SwapOptions)
# Fields whose default is their own, not the option's (the option's None means "the plan chooses").
OWN_DEFAULTS = {
    ("TrainConfig", "lr"): FROM_SCRATCH_LR,  # --lr unset: the model's (``default_lr``)
    ("RLOptions", "max_new_tokens"): 8,
    ("SwapOptions", "max_new_tokens"): 16,
    ("EngineOptions", "max_running_requests"): None,  # the engine's own batch limit
}
# Options of scope rl that reach the plan's options as something computed from them (not a bound field).
DERIVED = {
    "model_option": "TrainConfig.model_options (KEY=VALUE parsed)",
    "profile": "RLOptions.profile_steps (the step list parsed)",
}
# Options of scope rl that are the run's, not the plan's options: what ``mllm_rl.run`` itself uses.
RUN_LEVEL = {
    "backend": "picks the Backend the plan runs on",
    "plan": "picks the plan",
    "model": "resolved to the ModelDir the plan is given",
    "phase_timeout": "the run's watchdog (PhaseLimits)",
    "wandb": "the run's W&B sink",
    "wandb_project": "the run's W&B sink",
    "wandb_fallback": "the run's W&B sink",
    "wandb_timeout": "the run's W&B sink",
    "run_id": "the run's name",
    "run_dir": "the run's directory",
    "console": "what the run prints",
    "quiet": "what the run prints",
    "resume": "preflight finds the checkpoint (RLOptions.resume_from)",
    "resume_or_start": "preflight finds the checkpoint (RLOptions.resume_from)",
    "override": "compared against run.json by --resume",
}


def tree(cls: Any) -> list[Any]:
    """``cls`` and every options dataclass nested in it, by its fields' defaults."""
    found = [cls]
    for f in dataclasses.fields(cls):
        nested = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(nested) and type(nested) in CLASSES:
            found += tree(type(nested))
    return found


def bound_fields(cls: Any) -> list[dataclasses.Field[Any]]:
    return [f for f in dataclasses.fields(cls) if OPTION in f.metadata]


def default_problems(classes: tuple[Any, ...]) -> list[str]:
    """Every bound field whose default differs from its option's (unless listed in OWN_DEFAULTS)."""
    bad = []
    for cls in classes:
        for f in bound_fields(cls):
            want = OWN_DEFAULTS.get((cls.__name__, f.name), BY_KEY[f.metadata[OPTION]].default)
            own = (cls.__name__, f.name) in OWN_DEFAULTS
            if f.default != want or f.metadata[OWN_DEFAULT] != own:
                bad.append(f"{cls.__name__}.{f.name}: {f.default!r}, option {f.metadata[OPTION]}: {want!r}")
    return bad


def test_every_bound_field_has_its_options_default():
    assert default_problems(CLASSES) == []
    assert sum(len(bound_fields(c)) for c in CLASSES) > 40


def test_a_mismatched_default_is_caught():
    @dataclasses.dataclass(frozen=True)
    class Drifted:
        lr: float = dataclasses.field(
            default=1e-3, metadata={OPTION: "kl_beta", GIVEN: False, OWN_DEFAULT: False}
        )
        steps: int = opt("steps")

    assert default_problems((Drifted,)) == ["Drifted.lr: 0.001, option kl_beta: 0.0"]


def test_a_field_with_its_own_default_says_so():
    assert {(c.__name__, n) for c in CLASSES for n, f in ((f.name, f) for f in bound_fields(c))
            if f.metadata[OWN_DEFAULT]} == set(OWN_DEFAULTS)  # fmt: skip
    assert TrainConfig().lr == FROM_SCRATCH_LR


def test_every_rl_option_reaches_the_rl_options_tree():
    reached = {key for cls in tree(RLOptions) for key in bound(cls).values()}
    assert {TrainConfig, LossConfig, LifecycleOptions, EngineOptions} <= set(tree(RLOptions))
    keys = {o.key for o in in_scope("rl")}
    missing = keys - reached - set(DERIVED) - set(RUN_LEVEL)
    assert missing == set()
    assert not (reached & set(RUN_LEVEL)) and not (reached & set(DERIVED))  # the lists hold nothing stale
    assert (set(DERIVED) | set(RUN_LEVEL)) <= keys


def test_from_args_round_trips():
    values = {k: v for scope in ("rl", "swap", "tasks") for k, v in defaults(scope).items()}
    values.update(kl_beta=0.05, loss_agg="seq_mean_token_mean", loss_empty_seqs="count", eps_high=0.3)
    loss = from_args(LossConfig, values)
    back = {key: getattr(loss, name) for name, key in bound(LossConfig).items()}
    assert back == {key: values[key] for key in back}
    assert from_args(LossConfig, argparse.Namespace(**back)) == loss
    assert (loss.beta, loss.aggregation, loss.empty_seqs) == (0.05, "seq_mean_token_mean", "count")


def test_from_args_takes_what_it_is_given_and_refuses_what_is_missing():
    values = {k: v for scope in ("rl", "swap", "tasks") for k, v in defaults(scope).items()}
    train = from_args(TrainConfig, values, lr=0.5, temperature=0.7)
    assert (train.lr, train.temperature, train.seed) == (0.5, 0.7, values["seed"])
    with pytest.raises(KeyError, match="lr"):
        from_args(TrainConfig, values, temperature=1.0)  # lr is derived: the caller gives it
    with pytest.raises(KeyError, match="grad_clip"):
        from_args(TrainConfig, {k: v for k, v in values.items() if k != "grad_clip"}, lr=0.1, temperature=1.0)


def test_the_cli_builds_the_tree_from_the_flags():
    args, _ = parse_args(["--backend", "jax", "--kl-beta", "0.1", "--margin", "0.5", "--tis-cap", "2",
                          "--loss-agg", "dr_grpo", "--max-new-tokens", "12", "--fsdp", "2"])  # fmt: skip
    opts = build_options(args)
    assert (opts.train.loss.beta, opts.plan_margin, opts.lifecycle.tis_cap) == (0.1, 0.5, 2.0)
    assert (opts.train.loss.aggregation, opts.train.loss.max_len, opts.max_new_tokens) == ("dr_grpo", 12, 12)
    assert (opts.train.fsdp, opts.engine.seed) == (2, 0)


BAD = [
    (LossConfig, "beta", -1.0),
    (LossConfig, "kl_clamp", math.nan),
    (LossConfig, "aggregation", "sum"),
    (LifecycleOptions, "tis_cap", math.inf),
    (TrainConfig, "micro_batch_size", 0),
    (TrainConfig, "lora_alpha", 0.0),
    (RLOptions, "top_p", 1.5),
    (RLOptions, "group_size", 1),
    (RLOptions, "plan_margin", 0.0),
    (EngineOptions, "tp", 0),
]


@pytest.mark.parametrize("cls,name,value", BAD, ids=[f"{c.__name__}.{n}" for c, n, _ in BAD])
def test_a_bad_value_built_in_code_says_what_the_flag_says(cls, name, value):
    key = bound(cls)[name]
    with pytest.raises(OptionError) as e:
        cls(**{name: value})
    assert e.value.field == key
    with pytest.raises(ValueError) as flag:
        check_range(BY_KEY[key], value, cli_flag(key))
    assert e.value.named(cli_flag(key)) == str(flag.value)


def test_the_group_size_rule_is_the_schemas_with_its_reason():
    assert BY_KEY["group_size"].low == 2
    with pytest.raises(OptionError, match=r"^group_size 1: group-relative advantages need >= 2"):
        RLOptions(group_size=1)
    args, _ = parse_args(["--backend", "jax", "--group-size", "1"])
    with pytest.raises(ValueError, match=r"^--group-size 1: group-relative advantages need >= 2"):
        build_options(args)


def test_a_wrong_type_is_refused_not_crashed_on():
    with pytest.raises(OptionError, match="^kl_beta must be a number, got '0.1'"):
        LossConfig(beta="0.1")
    with pytest.raises(OptionError, match="^steps must be an integer, got 2.0"):
        check_fields(_with(RLOptions(), steps=2.0))


def _with(obj: Any, **kw: Any) -> Any:
    """``obj`` with ``kw`` set past its ``__post_init__`` (what ``check_fields`` is then given)."""
    for k, v in kw.items():
        object.__setattr__(obj, k, v)
    return obj

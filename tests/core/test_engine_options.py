"""``EngineOptions``: the typed engine options the CLI builds and both backends' ``create_engine`` take.

Nothing here starts an engine or imports jax/torch: an invalid option or engine/backend combination
is refused by validation, before any engine code runs.
"""

from __future__ import annotations

import inspect

import pytest

from mllm_rl.backend_registry import load_backend
from mllm_rl.engine import DEFAULT_CONTEXT_LENGTH, DEFAULT_MAX_TOTAL_TOKENS, EngineOptions
from mllm_rl.option_error import OptionError, cli_flag


@pytest.mark.parametrize(
    "kw,field,flag",
    [
        ({"tp": 0}, "tp", "--tp"),
        ({"max_total_tokens": 0}, "max_total_tokens", "--max-total-tokens"),
        ({"context_length": -5}, "context_length", "--context-length"),
        ({"max_running_requests": 0}, "max_running_requests", "--max-running-requests"),
        ({"chunk_bytes": -1}, "chunk_bytes", "--swap-chunk-mb"),
        ({"tp": True}, "tp", "--tp"),
        ({"tp": 2.0}, "tp", "--tp"),
        ({"engine": "vllm"}, "engine", "--engine"),
    ],
)
def test_invalid_options_are_refused_naming_the_field_which_the_cli_spells_as_its_flag(kw, field, flag):
    with pytest.raises(OptionError) as e:
        EngineOptions(**kw)
    assert e.value.field == field and str(e.value).startswith(f"{field} ") and "--" not in str(e.value)
    assert cli_flag(e.value.field) == flag


def test_resolved_fills_only_what_was_not_chosen():
    o = EngineOptions(context_length=128).resolved()
    assert (o.context_length, o.max_total_tokens) == (128, DEFAULT_MAX_TOTAL_TOKENS)
    o = EngineOptions().resolved()
    assert (o.context_length, o.max_total_tokens, o.max_running_requests) == (
        DEFAULT_CONTEXT_LENGTH, DEFAULT_MAX_TOTAL_TOKENS, None,
    )  # fmt: skip


@pytest.mark.parametrize("name", ["jax", "torch"])
def test_both_backends_create_engine_take_one_engine_options(name):
    backend = load_backend(name)
    for method in ("create_engine", "check_engine_args"):
        params = list(inspect.signature(getattr(backend, method)).parameters)
        assert params == ["model", "opts"], (name, method, params)
    assert "auto" in backend.engines


def test_jax_backend_refuses_other_engines_by_validation_not_a_type_error():
    jax_backend = load_backend("jax")
    for engine in ("embedded", "sglang"):
        with pytest.raises(ValueError, match=f"--engine {engine}: not an engine of the jax backend"):
            jax_backend.create_engine(None, EngineOptions(engine=engine))  # refused before the model is read
    EngineOptions(engine="auto").check_backend("jax", jax_backend.engines)


def test_torch_backend_takes_all_three_engine_choices():
    torch_backend = load_backend("torch")
    for engine in ("auto", "embedded", "sglang"):
        EngineOptions(engine=engine).check_backend("torch", torch_backend.engines)


def test_an_rl_runs_kv_pool_holds_one_generate_at_full_length():
    """Unset ``--kv-tokens``: the requests one generate holds (a rollout's prompts x samples, or the
    held-out prompts of an evaluation; at most ``--max-running-requests``) x the context."""
    from mllm_rl.plans.rl import RLOptions, size_engine

    def pool(engine: dict | None = None, **kw: int) -> int | None:
        opts = RLOptions(engine=EngineOptions(context_length=64, **(engine or {})), **kw)
        return size_engine(None, None, opts).max_total_tokens  # context set: no task or tokenizer read

    assert pool(prompts_per_step=16, group_size=8) == 128 * 64  # the default batch: max-running-requests
    assert pool(prompts_per_step=8, group_size=4) == 32 * 64
    assert pool(prompts_per_step=2, group_size=4) == 16 * 64  # the 16 held-out prompts (--eval-prompts)
    assert pool(prompts_per_step=2, group_size=4, eval_prompts=4) == 8 * 64
    assert pool({"max_running_requests": 24}, prompts_per_step=8, group_size=4) == 24 * 64
    assert pool({"max_total_tokens": 5000}, prompts_per_step=2, group_size=4) == 5000

"""The plan interface and registry: ``--plan`` choices, options, phases and ``run.json`` come from
each plan (``mllm_rl.plans.base.Plan``), so ``mllm_rl.run`` never tests for a plan's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mllm_rl.plans.base import DEFAULT_PLAN, Plan, all_plans, get_plan, plan_names
from mllm_rl.plans.preflight import build_options, known_phases
from mllm_rl.plans.rl import RLOptions
from mllm_rl.plans.swap import SwapOptions
from mllm_rl.run import build_parser, parse_args
from tests.conftest import run_cli

ROOT = Path(__file__).resolve().parents[2]


class FakeBackendNames:
    name, ready_phase = "fake", "fake_ready"


def test_every_registered_plan_is_a_plan_of_its_name():
    assert plan_names()[0] == DEFAULT_PLAN
    for name in plan_names():
        plan = get_plan(name)
        assert isinstance(plan, Plan) and plan.name == name and plan.summary


def test_an_unknown_plan_is_one_line_naming_the_choices():
    with pytest.raises(ValueError, match=r"^--plan 'ppo': choose one of rl, swap$"):
        get_plan("ppo")


def test_the_cli_offers_exactly_the_registered_plans():
    (action,) = [a for a in build_parser()._actions if "--plan" in a.option_strings]
    assert list(action.choices) == plan_names() and parse_args(["--backend", "x"])[0].plan == DEFAULT_PLAN


@pytest.mark.parametrize("name,kind", [("rl", RLOptions), ("swap", SwapOptions)])
def test_options_come_from_the_plan_and_run_json_names_its_phases(name, kind):
    args, _ = parse_args(["--backend", "jax", "--plan", name])
    opts = build_options(args)
    assert type(opts) is kind
    info = get_plan(name).run_json(FakeBackendNames(), opts)
    assert "fake_ready" in info["expected_phases"] and "{ready}" not in str(info)
    assert set(info["expected_phases"]) | set(info["expected_step_phases"]) <= {
        p.format(ready="fake_ready") for p in get_plan(name).phase_names()
    }


def test_phase_timeouts_may_name_every_phase_of_every_plan():
    for plan in all_plans():
        assert {p for p in plan.phase_names() if "{" not in p} <= known_phases()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--prompt", "hi"], "--prompt: only --plan swap takes it"),
        (["--plan", "swap", "--task-data", "x"], "--task-data x: only --plan rl takes it"),
        (["--plan", "swap", "--resume", "--run-dir", "r"], "--resume: only --plan rl and --tasks take it"),
        (["--plan", "swap", "--steps", "20"], "--steps 20: only --plan rl takes it"),  # even its default
        (["--plan", "swap", "--seq-len", "9"], "unrecognized arguments: --seq-len"),  # memplan's own
    ],
)
def test_a_flag_of_another_mode_is_refused_not_ignored(flags, message):
    r = run_cli("mllm_rl.run", "--backend", "jax", *flags)
    assert (
        r.returncode == 2
        and r.stderr.strip().splitlines() == [f"error: {message}"]
        or (r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1)
    ), r.stderr


def test_the_runner_never_branches_on_a_plan_name():
    """A new plan is a registry line and a ``Plan``; ``run.py`` and the preflight stay as they are."""
    for rel in ("mllm_rl/run.py", "mllm_rl/plans/preflight.py"):
        tree = ast.parse((ROOT / rel).read_text())
        hits = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Compare)
            and any(isinstance(c, ast.Constant) and c.value in plan_names() for c in node.comparators)
        ]
        assert hits == [], f"{rel}: lines {hits} compare with a plan name"

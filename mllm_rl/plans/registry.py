"""The plans ``--plan`` chooses from, by name, each imported only when asked for."""

from __future__ import annotations

import importlib
from typing import Any

from mllm_rl.options.schema import BY_KEY
from mllm_rl.plans.base import Plan

# name -> "module:attribute" of its ``Plan`` instance; the first is the default
PLANS = {
    "rl": "mllm_rl.plans.rl:PLAN",
    "swap": "mllm_rl.plans.swap:PLAN",
    "multitask": "mllm_rl.multitask.plan:PLAN",
}
TASKS_PLAN = "multitask"  # run by ``--tasks FILE``, not by a --plan value
DEFAULT_PLAN = BY_KEY["plan"].default  # declared with the option (``mllm_rl.options.schema``)


def plan_names() -> list[str]:
    """What ``--plan`` offers (a multi-task run is chosen by ``--tasks``)."""
    return [n for n in PLANS if n != TASKS_PLAN]


def plan_of(args: Any) -> Plan:
    """The plan a command line runs: ``--tasks`` or ``--plan``."""
    return get_plan(TASKS_PLAN if getattr(args, "tasks", None) else args.plan)


def get_plan(name: str) -> Plan:
    """The plan called ``name``; ``ValueError`` (one line) when there is none."""
    if name not in PLANS:
        raise ValueError(f"--plan {name!r}: choose one of {', '.join(plan_names())}")
    module, attr = PLANS[name].split(":")
    plan = getattr(importlib.import_module(module), attr)
    if not isinstance(plan, Plan) or plan.name != name:
        raise TypeError(f"{PLANS[name]} is not the Plan {name!r}")
    return plan


def all_plans() -> list[Plan]:
    return [get_plan(n) for n in PLANS]

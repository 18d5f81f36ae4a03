"""``python -m mllm_rl.memplan.child``: a run's memory plan made in a fresh process.

A run on a TPU or a GPU has its JAX on that platform; the planner compiles for the target with the
target's compiler loaded into a JAX on its CPU platform (``backends/jax/topologies.py``: nothing
runs on a device), which that process cannot become. So ``mllm_rl.memplan.for_run`` runs
``plan_run`` here instead: the request and flags as JSON on stdin, the result as one JSON object
on stdout (``{"plan": RunPlan}``, ``{"does_not_fit": message}`` or ``{"error": message}``);
progress on stderr. ``for_run.run_child`` starts it with the planner's own environment: the run's
TPU / JAX settings are not passed on, so the child is what ``python -m mllm_rl.memplan`` is on any
machine.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

from mllm_rl.memplan.request import PlanRequest
from mllm_rl.presets import ModelConfig


def request_from_json(d: dict[str, Any]) -> PlanRequest:
    return PlanRequest(**{**d, "model": ModelConfig(**d["model"])})


def main() -> int:
    from mllm_rl.memplan.for_run import DoesNotFit, plan_run

    data = json.loads(sys.stdin.read())
    req = request_from_json(data["request"])
    try:
        plan = plan_run(req, bool(data["check_weights"]), bool(data["fit_kv"]), in_process=True)
        out: dict[str, Any] = {"plan": dataclasses.asdict(plan)}
    except DoesNotFit as e:
        out = {"does_not_fit": str(e)}
    except (ValueError, RuntimeError) as e:
        out = {"error": str(e)}
    print(json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

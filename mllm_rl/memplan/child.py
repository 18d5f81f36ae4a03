"""``python -m mllm_rl.memplan.child``: a run's memory plan in a fresh process (the planner needs a
JAX on its CPU platform, which a TPU/GPU run's process cannot become). Request as JSON on stdin;
one JSON object on stdout: ``{"plan": ...}``, ``{"does_not_fit": ...}`` or ``{"error": ...}``."""

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

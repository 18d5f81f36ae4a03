"""The run held against its own plan: every phase's measured device bytes against the plan's.

A run planned before start-up (``mllm_rl.memplan.for_run``) has ``plan.json`` in its directory;
``audit(records, doc)`` compares (``mllm_rl.memplan.validate.compare``) and ``drifts`` names the
phases that ended with more bytes in use than the plan says stay resident, by more than
``TOLERANCE`` (and a MiB): memory the plan does not know of, a leak when it grows step by step.
Fewer bytes than predicted is not a finding (the plan bounds). Single-device runs: the plan is made
for one device's share.
"""

from __future__ import annotations

from typing import Any

from mllm_rl.memplan.compose import SETUP_PREFIX
from mllm_rl.memplan.validate import NOISE_BYTES, compare

TOLERANCE = 0.05


def audit(records: list[dict[str, Any]], doc: dict[str, Any]) -> dict[str, Any]:
    """``validate.compare`` of the records against ``doc`` (``ValueError`` when they cannot be
    compared, e.g. a run over several devices): the last step's phases, and in ``previous`` the step
    before's (a step's phase must be above the plan in both to drift: an array released late at one
    phase's end is not memory the plan misses)."""
    check = compare(records, doc, TOLERANCE)
    steps = sorted({r["step"] for r in records if r.get("step") is not None})
    if len(steps) > 1:
        before = [r for r in records if r.get("step") is None or r["step"] < steps[-1]]
        check["previous"] = [
            r for r in compare(before, doc, TOLERANCE)["phases"] if not r["phase"].startswith(SETUP_PREFIX)
        ]
    return check


def _above(r: dict[str, Any], tolerance: float) -> bool:
    return r["measured"] > r["predicted"] * (1 + tolerance) + NOISE_BYTES


def drifts(check: dict[str, Any]) -> list[dict[str, Any]]:
    """The phases whose end-of-phase bytes exceed the prediction by more than the tolerance (a step's
    phase: in each of the last two steps, when the run had two)."""
    tol = check["tolerance"]
    if "previous" not in check:
        return [r for r in check["phases"] if _above(r, tol)]
    earlier = {r["phase"] for r in check["previous"] if _above(r, tol)}
    return [
        r
        for r in check["phases"]
        if _above(r, tol) and (r["phase"].startswith(SETUP_PREFIX) or r["phase"] in earlier)
    ]


def summary(check: dict[str, Any]) -> str:
    """One line: how many phases held to the plan."""
    n, bad = len(check["phases"]), drifts(check)
    if not bad:
        return f"memory plan: {n} of {n} phases ended within {check['tolerance']:.0%} of the prediction or below it"
    worst = max(bad, key=lambda r: r["measured"] - r["predicted"])
    return (
        f"memory plan: {len(bad)} of {n} phases ended above the prediction by more than "
        f"{check['tolerance']:.0%}; worst {worst['phase']}: {worst['measured'] / 2**20:.1f} MiB in use, "
        f"{worst['predicted'] / 2**20:.1f} MiB predicted"
    )

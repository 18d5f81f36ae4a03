"""The run held against its own plan: every phase's measured device bytes against the plan's.

A run planned before start-up (``mllm_rl.memplan.for_run``) has ``plan.json`` in its directory;
``audit(records, doc)`` compares (``mllm_rl.memplan.validate.compare``) and ``drifts`` names the
phases that ended with more bytes in use than the plan says stay resident, by more than
``TOLERANCE`` (and a MiB): memory the plan does not know of, a leak when it grows step by step.
Fewer bytes than predicted is not a finding (the plan bounds). The plan is one device's share; a run
over several devices is held by its fullest device.
"""

from __future__ import annotations

from typing import Any

from mllm_rl.memplan.validate import NOISE_BYTES, compare

TOLERANCE = 0.05


def audit(records: list[dict[str, Any]], doc: dict[str, Any]) -> dict[str, Any]:
    """``validate.compare`` of the records against ``doc`` (``ValueError`` when they cannot be
    compared): setup's and the last step's phases, each step phase with the step before's bytes
    (``measured_before``)."""
    return compare(records, doc, TOLERANCE)


def _above(measured: int | None, predicted: int, tolerance: float) -> bool:
    return measured is not None and measured > predicted * (1 + tolerance) + NOISE_BYTES


def drifts(check: dict[str, Any]) -> list[dict[str, Any]]:
    """The phases whose end-of-phase bytes exceed the prediction by more than the tolerance (a step's
    phase: in each of the last two steps when the run had two; an array released late at one
    phase's end is not memory the plan misses)."""
    tol = check["tolerance"]
    return [
        r
        for r in check["phases"]
        if _above(r["measured"], r["predicted"], tol)
        and (r.get("measured_before") is None or _above(r["measured_before"], r["predicted"], tol))
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


def table(check: dict[str, Any]) -> str:
    """Predicted vs measured bytes at the end of every phase (setup's, then the last step's), in one
    unit, the step before's measured bytes and whether the phase drifts (``drifts``)."""
    from mllm_rl.memplan.compose import unit_for

    rows = check["phases"]
    unit, scale = unit_for(max([1, *(max(r["predicted"], r["measured"] or 0) for r in rows)]))
    drifting = {id(r) for r in drifts(check)}
    head = (
        f"{'phase':<30} {'predicted ' + unit:>14} {'measured ' + unit:>13} {'step before':>12} {'ratio':>6}  "
        f"{'within ' + format(check['tolerance'], '.0%'):<10}"
    )
    lines = ["Memory plan vs run (bytes in use at each phase's end; PREDICTED by the plan, MEASURED by the run):",
             head, "-" * len(head)]  # fmt: skip
    for r in rows:
        before = "-" if r.get("measured_before") is None else f"{r['measured_before'] / scale:.2f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        verdict = "DRIFT" if id(r) in drifting else ("yes" if r["within"] else "below")
        lines.append(
            f"{r['phase']:<30} {r['predicted'] / scale:>14.2f} {(r['measured'] or 0) / scale:>13.2f} "
            f"{before:>12} {ratio:>6}  {verdict:<10}"
        )
    return "\n".join(lines)

"""Findings of a run held against the memory plan it made before start-up (``plan.json`` in its
directory; ``mllm_rl.memplan.audit``): a phase that ended with more device bytes in use than the
plan says stay resident is a warning (memory the plan does not know of; a leak when it grows)."""

from __future__ import annotations

import json
from typing import Any

from mllm_rl.report.issues import INFO, WARNING, Issue
from mllm_rl.report.load import Run

MIB = 2**20


def plan_audit(run: Run) -> tuple[list[Issue], dict[str, Any] | None]:
    """The findings, and the comparison (``mllm_rl.memplan.validate.compare``; None without a plan)."""
    path = run.dir / "plan.json"
    if not path.is_file():
        return [], None
    from mllm_rl.memplan.audit import audit, drifts

    try:
        doc = json.loads(path.read_text())
        check = audit(run.records.get(0, []), doc)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [
            Issue(run.label, "plan_audit", f"{path} not compared with the records: {e}", severity=INFO)
        ], None
    check["target"] = doc.get("plans", {}).get(doc.get("schedule"), {}).get("target", {}).get("name")
    return [
        Issue(
            run.label,
            "plan_drift",
            f"{r['phase']}: {r['measured'] / MIB:.1f} MiB in use at its end, the plan predicted "
            f"{r['predicted'] / MIB:.1f} MiB ({', '.join(r['resident_at_end']) or 'nothing'} resident): memory "
            f"the plan does not know of (a leak if it grows step by step)",
            severity=WARNING,
            process=0,
        )
        for r in drifts(check)
    ], check

"""Everything the report derives from one run, computed once: attempts, expectations, findings, tables."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from mllm_rl.memplan.audit import check_run_dir, drift_messages
from mllm_rl.report.checks import (
    Expected,
    completeness,
    first_phase_guess,
    from_plan,
    health_issues,
    host_growth,
    inferred,
)
from mllm_rl.report.issues import INFO, WARNING, Issue
from mllm_rl.report.load import Attempt, Run, split_attempts
from mllm_rl.report.memory import pick_unit
from mllm_rl.report.tables import efficiency_rows, phase_rows, step_metrics, swap_ratios


@dataclass
class RunAnalysis:
    run: Run
    expected: Expected
    attempts: dict[int, list[Attempt]]
    issues: list[Issue]
    phases: list[dict[str, Any]]
    efficiency: list[dict[str, Any]]
    swaps: list[dict[str, Any]]
    metrics: list[dict[str, Any]]
    plan_check: dict[str, Any] | None = None  # the run against its plan.json (``memplan.audit``)

    @property
    def unit(self) -> tuple[int, str]:
        """One display unit for the run's device bytes (GiB, or MiB for tiny runs)."""
        vals = [v for r in self.phases for v in (r["peak_bytes"], r["after_bytes"]) if v is not None]
        return pick_unit(max(vals, default=None))

    @property
    def host_unit(self) -> tuple[int, str]:
        vals = [r["host_rss_peak_bytes"] for r in self.phases if r["host_rss_peak_bytes"] is not None]
        return pick_unit(max(vals, default=None))

    def summary(self) -> dict[str, Any]:
        run, exp = self.run, self.expected
        plan = run.plan or {}
        return {
            "label": run.label,
            "dir": str(run.dir),
            "run_id": run.run_id,
            "backend": run.backend,
            "plan": plan.get("plan"),
            "model": plan.get("model"),
            "records": run.n_records,
            "processes": sorted(p for p, recs in run.records.items() if recs),
            "attempts": {str(p): len(a) for p, a in self.attempts.items()},
            "wall_seconds": None if run.t0 is None or run.t1 is None else run.t1 - run.t0,
            "phase_files": [f.name for f in run.files.values()],
            "expected": {"source": exp.source} | asdict(exp),
        }


def plan_findings(run: Run) -> tuple[list[Issue], dict[str, Any] | None]:
    """The run against its own ``plan.json`` (``memplan.audit.check_run_dir``; None without one): a
    note when they cannot be compared, a warning per phase that ended above the plan."""
    check, not_compared = check_run_dir(run.dir, run.records.get(0, []))
    if not_compared:
        return [Issue(run.label, "plan_audit", not_compared, severity=INFO)], None
    msgs = drift_messages(check) if check else []
    return [Issue(run.label, "plan_drift", m, severity=WARNING, process=0) for m in msgs], check


def analyze(run: Run) -> RunAnalysis:
    """Split attempts, work out what was expected, check completeness, build the tables."""
    planned = (run.plan or {}).get("expected_phases")
    if isinstance(planned, list) and all(isinstance(x, str) for x in planned):
        first = planned[0] if planned else None
    else:
        first = first_phase_guess(run)
    attempts = {p: split_attempts(p, recs, first) for p, recs in run.records.items()}
    exp = from_plan(run, inferred(run, {p: [a.records for a in atts] for p, atts in attempts.items()}))
    efficiency = efficiency_rows(run.label, attempts)
    plan_found, plan_check = plan_findings(run)
    issues = completeness(run, exp, attempts) + health_issues(run.label, attempts)
    issues += efficiency_issues(run.label, efficiency) + plan_found + host_growth(run)
    phases, swaps = phase_rows(run.label, attempts, run.t0), swap_ratios(run.label, attempts)
    return RunAnalysis(run, exp, attempts, issues, phases, efficiency, swaps, step_metrics(run), plan_check)


def efficiency_issues(label: str, rows: list[dict[str, Any]]) -> list[Issue]:
    """A warning per flagged release (listed with the findings; it does not fail the check)."""
    where = ("process", "attempt", "step", "phase")
    return [
        Issue(label, "release_efficiency", f"{r['phase']} {r['note']}", WARNING, **{k: r[k] for k in where})
        for r in rows
        if r["flagged"]
    ]

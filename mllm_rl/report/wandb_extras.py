"""Log the report into an open W&B run (``log_report(wandb_sink.run, build_report([run_dir]))`` before
the sink closes): tables, the SVG charts as ``wandb.Html`` and summary values, under ``report/``.
Unknown values stay ``None`` (empty cells), never 0; ``wandb`` is imported only when called."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from mllm_rl.report.analysis import RunAnalysis
from mllm_rl.report.build import ReportResult
from mllm_rl.report.html import CSS
from mllm_rl.report.issues import ERROR, WARNING, count
from mllm_rl.report.plots import memory_over_time_charts, memory_per_phase_charts, metric_charts
from mllm_rl.report.tables import PHASE_COLUMNS

EFFICIENCY_COLUMNS = tuple(
    "run process attempt step phase kind source actual_bytes expected_bytes ratio flagged note".split()
)
ISSUE_COLUMNS = tuple("run severity kind process attempt step phase message".split())
PLAN_COLUMNS = tuple(
    "run target phase predicted_bytes measured_bytes measured_before_bytes ratio within drift "
    "predicted_peak_bytes".split()
)


def plan_rows(result: ReportResult) -> list[dict[str, Any]]:
    """Per phase of every run with a ``plan.json``: predicted bytes at its end against measured ones."""
    from mllm_rl.memplan.audit import drifts

    out = []
    for an, check in ((an, an.plan_check) for an in result.analyses if an.plan_check):
        drifting = {r["phase"] for r in drifts(check)}
        for r in check["phases"]:
            out.append(
                {
                    "run": an.run.label,
                    "target": check.get("target"),
                    "phase": r["phase"],
                    "predicted_bytes": r["predicted"],
                    "measured_bytes": r["measured"],
                    "measured_before_bytes": r.get("measured_before"),
                    "ratio": r["ratio"],
                    "within": r["within"],
                    "drift": r["phase"] in drifting,
                    "predicted_peak_bytes": r["predicted_during"],
                }
            )
    return out


def report_payload(result: ReportResult, plan: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``wandb.log`` dict for ``result`` and its ``plan_rows`` (imports wandb)."""
    import wandb

    def table(columns: tuple[str, ...], rows: list[dict[str, Any]]) -> Any:
        data = [[r.get(c) for c in columns] for r in rows]
        return wandb.Table(columns=list(columns), data=data, allow_mixed_types=True)

    def html(charts: Callable[[RunAnalysis], str], analyses: list[RunAnalysis]) -> Any:
        body = "".join(charts(an) for an in analyses)
        page = f"<!DOCTYPE html><html><head><meta charset='utf-8'><style>{CSS}</style></head><body>{body}</body></html>"
        return wandb.Html(page, inject=False, data_is_not_path=True)

    analyses = result.analyses
    payload = {
        "report/phases": table(PHASE_COLUMNS, [r for an in analyses for r in an.phases]),
        "report/efficiency": table(EFFICIENCY_COLUMNS, [r for an in analyses for r in an.efficiency]),
        "report/issues": table(ISSUE_COLUMNS, [i.to_json() for i in result.issues]),
        "report/memory_per_phase": html(memory_per_phase_charts, analyses),
        "report/memory_over_time": html(memory_over_time_charts, analyses),
    }
    if plan:
        payload["report/memory_plan"] = table(PLAN_COLUMNS, plan)
    if any(an.metrics for an in analyses):
        payload["report/step_metrics"] = html(metric_charts, [an for an in analyses if an.metrics])
    return payload


def log_report(wandb_run: Any, result: ReportResult, strict: bool = False) -> list[str]:
    """Log ``result`` into ``wandb_run``; returns the logged keys. ``strict=False`` (the sink at
    run end): a failure prints one line and returns ``[]`` so the run keeps its W&B data."""
    try:
        plan = plan_rows(result)
        payload = report_payload(result, plan)
        wandb_run.log(payload)
        ratios = [r["ratio"] for an in result.analyses for r in an.swaps if r["ratio"] is not None]
        counts, summary = count(result.issues), wandb_run.summary
        summary["report/errors"], summary["report/warnings"] = counts[ERROR], counts[WARNING]
        if ratios:
            summary["report/swap_peak_over_steady"] = max(ratios)
        if plan:  # how many phases held to the run's own memory plan
            summary["report/plan_phases"] = len(plan)
            summary["report/plan_drifts"] = sum(r["drift"] for r in plan)
        return list(payload)
    except Exception as e:
        if strict:
            raise
        print(f"warning: report not logged to W&B: {type(e).__name__}: {e}", file=sys.stderr)
        return []

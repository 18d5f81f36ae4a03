"""Multi-task runs (``run.json`` has ``tasks``; schema ``mllm_rl.phase/2``): one ``Run`` per task.

``split_tasks`` splits a run into its run-level part (task ``null``) and one part per task (label
``<run> / <task>``, its records and ``run.json["tasks"][task]`` expectations), so completeness,
charts, tables and trace work per task; all parts keep the run's time origin so lanes line up.
A task ``run.json`` marks failed is a ``task_failed`` error; an unlisted task an ``unknown_task``
warning."""

from __future__ import annotations

from mllm_rl.report.issues import ERROR, WARNING, Issue
from mllm_rl.report.load import Run

TASK_KEYS = ("expected_phases", "expected_step_phases", "steps", "first_step")


def _part(run: Run, task: str | None, plan: dict, label: str) -> Run:
    records = {p: [r for r in recs if r.get("task") == task] for p, recs in run.records.items()}
    torn = run.torn_lines if task is None else []
    return Run(run.dir, label, records, plan, run.files, torn, origin_t0=run.t0)


def split_tasks(run: Run) -> list[Run]:
    """``[run]`` for a single-task run; else its run-level part and one part per task."""
    tasks = (run.plan or {}).get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        return [run]
    base = {k: v for k, v in (run.plan or {}).items() if k != "tasks"}
    parts = [_part(run, None, base, run.label)]
    for name, t in tasks.items():
        t = t if isinstance(t, dict) else {}
        plan = {
            **base,
            **{k: t[k] for k in TASK_KEYS if k in t},
            "task": name,
            "task_status": t.get("status"),
            "task_error": t.get("error"),
        }
        parts.append(_part(run, name, plan, f"{run.label} / {name}"))
    return parts


def task_issues(run: Run, parts: list[Run]) -> list[Issue]:
    """``task_failed`` per failed task, ``unknown_task`` for records of tasks run.json does not list."""
    out = []
    for part in parts[1:]:
        plan = part.plan or {}
        if plan.get("task_status") == "failed":
            out.append(
                Issue(
                    part.label,
                    "task_failed",
                    f"task {plan['task']} failed: {plan.get('task_error')}"[:500],
                    ERROR,
                )
            )
    known = {(p.plan or {}).get("task") for p in parts[1:]} | {None}
    seen = {r.get("task") for _, r in run.all_records()}
    for name in sorted(str(t) for t in seen - known):
        out.append(
            Issue(
                run.label, "unknown_task", f"records of task {name!r}, which run.json does not list", WARNING
            )
        )
    return out

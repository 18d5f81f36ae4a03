"""``build_report``: load runs, analyze them, write ``trace.json``, ``report.html``, ``summary.json``;
``report_at_exit``: the report a run (``python -m mllm_rl.run``) writes as it ends."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mllm_rl.phases.jsonsafe import dumps
from mllm_rl.report.analysis import RunAnalysis, analyze
from mllm_rl.report.html import render
from mllm_rl.report.issues import ERROR, Issue, count, group_issues, sort_issues
from mllm_rl.report.load import ReportInputError, load_runs, split_tasks, task_issues
from mllm_rl.report.tables import compare_rows
from mllm_rl.report.trace import build_trace

if TYPE_CHECKING:
    from mllm_rl.phases.recorder import PhaseRecorder

SUMMARY_SCHEMA = "mllm_rl.report/1"
MAX_LINES = 10  # findings a run prints on stderr as it ends (all of them are in the report)


@dataclass
class ReportResult:
    out_dir: Path
    files: dict[str, Path]  # "trace", "html", "summary"
    issues: list[Issue]
    analyses: list[RunAnalysis]
    comparison: list[dict[str, Any]] | None = None
    seconds: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def errors(self) -> list[Issue]:
        return [i for i in self.issues if i.severity == ERROR]

    @property
    def exit_code(self) -> int:
        """The CLI's status: 1 if any error-level finding, else 0."""
        return 1 if self.errors else 0


def _write(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def summary_json(
    analyses: list[RunAnalysis],
    issues: list[Issue],
    comparison: list[dict[str, Any]] | None,
    files: dict[str, Path],
) -> dict[str, Any]:
    return {
        "schema": SUMMARY_SCHEMA,
        "generated_at": time.time(),
        "runs": [an.summary() for an in analyses],
        "counts": count(issues),
        "issues": [i.to_json() for i in issues],
        "swap_ratios": [r for an in analyses for r in an.swaps],
        "efficiency": [r for an in analyses for r in an.efficiency],
        "step_metrics": {an.run.label: an.metrics for an in analyses},
        "phases": [r for an in analyses for r in an.phases],
        "comparison": comparison,
        "files": {k: str(v) for k, v in files.items()},
    }


def build_report(run_dirs: list[str | Path] | str | Path, out_dir: str | Path | None = None) -> ReportResult:
    """Write the report of one or several run directories into ``out_dir``; return what it found.
    Raises ``ReportInputError`` (one line naming the file) only on bad input, not on a failed run."""
    t = time.perf_counter()
    dirs = [Path(run_dirs)] if isinstance(run_dirs, (str, Path)) else [Path(d) for d in run_dirs]
    if not dirs:
        raise ValueError("build_report: no run directory given")
    split = [(run, split_tasks(run)) for run in load_runs(dirs)]  # multi-task runs: one part per task
    analyses = [analyze(r) for _, parts in split for r in parts]
    extra = [i for run, parts in split for i in task_issues(run, parts)]
    issues = sort_issues([i for an in analyses for i in an.issues] + extra)
    comparison = compare_rows([an.attempts for an in analyses]) if len(dirs) > 1 else None
    if out_dir is None:  # RUN_DIR/report for one run, ./report-compare for several
        out_dir = dirs[0] / "report" if len(dirs) == 1 else Path("report-compare")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"trace": out / "trace.json", "html": out / "report.html", "summary": out / "summary.json"}
    runs = [(an.run.label, an.run.t0, an.attempts) for an in analyses]
    labels, t0s = [r[0] for r in runs], [r[1] for r in runs]
    trace = build_trace(runs, {"runs": labels, "t0_epoch_s": t0s, "issues": [i.line() for i in issues]})
    _write(files["trace"], dumps(trace, separators=(",", ":")))
    _write(files["html"], render(analyses, issues, comparison))
    summary = summary_json(analyses, issues, comparison, files)
    _write(files["summary"], dumps(summary, separators=(",", ":")))
    return ReportResult(out, files, issues, analyses, comparison, time.perf_counter() - t, summary)


def report_at_exit(run_dir: Path, rec: PhaseRecorder, quiet: bool = False) -> None:
    """``run_dir/report/``, also into the run's open W&B sink; the errors on stderr, one line per group.
    A report problem is a warning, never the run's failure."""
    try:
        report = build_report([run_dir])
    except (ReportInputError, OSError, ValueError) as e:
        if not quiet:
            print(f"warning: report: {e}", file=sys.stderr)
        return
    rec.log_report(report)
    for issue, where in group_issues(report.errors)[:MAX_LINES]:
        print(f"report: {issue.line(where)}", file=sys.stderr)
    if not quiet:
        print(f"report {run_dir / 'report' / 'report.html'}", file=sys.stderr)

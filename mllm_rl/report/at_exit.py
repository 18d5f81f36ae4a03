"""The report a run writes as it ends (``python -m mllm_rl.run``, single- and multi-task)."""

from __future__ import annotations

import sys
from pathlib import Path

from mllm_rl.phases.recorder import PhaseRecorder
from mllm_rl.report.build import build_report
from mllm_rl.report.issues import group_issues
from mllm_rl.report.load import ReportInputError

MAX_LINES = 10  # report findings printed on stderr (all of them are in the report)


def report_at_exit(run_dir: Path, rec: PhaseRecorder, quiet: bool = False) -> None:
    """``run_dir/report/`` (trace.json, report.html, summary.json), also into the run's open W&B
    sink (``rec.log_report``); the findings on stderr, one line per group. A report problem is a
    warning, never the run's failure. In a multi-process run the others may still be writing:
    ``python -m mllm_rl.report RUN_DIR`` redoes it afterwards."""
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

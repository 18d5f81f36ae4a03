"""Memory reports of recorded runs: Perfetto trace, static HTML, machine-readable summary.

    from mllm_rl.report import build_report
    result = build_report(["runs/<id>"])          # writes runs/<id>/report/{trace.json,report.html,summary.json}
    result.issues, result.exit_code, result.files

CLI: ``python -m mllm_rl.report RUN_DIR [RUN_DIR ...] [--out DIR]`` (docs/REPORT.md).
Imports neither jax nor torch, nor any plotting library.
"""

from mllm_rl.report.build import ReportResult, build_report
from mllm_rl.report.issues import Issue
from mllm_rl.report.load import ReportInputError

__all__ = ["Issue", "ReportInputError", "ReportResult", "build_report"]

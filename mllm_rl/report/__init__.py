"""Memory reports of recorded runs: Perfetto trace, static HTML, machine-readable summary
(``build_report(["runs/<id>"])`` writes ``runs/<id>/report/``; CLI ``python -m mllm_rl.report``,
docs/REPORT.md). Imports neither jax nor torch, nor any plotting library."""

from mllm_rl.report.build import ReportResult, build_report
from mllm_rl.report.issues import Issue
from mllm_rl.report.load import ReportInputError

__all__ = ["Issue", "ReportInputError", "ReportResult", "build_report"]

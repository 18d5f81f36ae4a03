"""``python -m mllm_rl.report RUN_DIR [RUN_DIR ...] [--out DIR]``. Exit status: 0 clean; 1 any
error-level finding; 2 bad input (one line on stderr naming the file)."""

from __future__ import annotations

import argparse
import sys

from mllm_rl.report.build import build_report
from mllm_rl.report.issues import count, group_issues
from mllm_rl.report.load import ReportInputError


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mllm_rl.report",
        description="Memory report of recorded runs: trace.json (Perfetto), report.html, summary.json. "
        "Several run directories: a side-by-side comparison.",
    )
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory (holds phases.jsonl)")
    help_out = "output directory (default: RUN_DIR/report for one run, ./report-compare for several)"
    ap.add_argument("--out", default=None, help=help_out)
    ap.add_argument("--quiet", action="store_true", help="print only errors and the exit summary")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = build_report(args.run_dirs, args.out)
    except ReportInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # e.g. --out names a file, or is not writable
        print(f"error: {e.filename or args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    for issue, where in group_issues(result.issues):
        if not args.quiet or issue.severity == "error":
            print(issue.line(where), file=sys.stderr)
    c, files = count(result.issues), result.files
    found = f"{c['error']} error(s), {c['warning']} warning(s), {c['info']} note(s)"
    trace = f"trace {files['trace']}; {result.seconds:.2f} s"
    print(f"report: {files['html']} ({found}; {trace})", file=sys.stderr)
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())

"""Time ``build_report`` on synthetic runs of growing size (the report must stay linear in records).

    python scripts/bench_report.py [--processes 4] [--steps 5 10 20 40] [--repeats 3]

Writes a run per size with the test fixture ``tests/core/report_fixtures.write_rl_run``
(schema-valid JSONL of every RL phase, ``--processes`` processes, two CUDA devices each), then
prints records, best-of-``--repeats`` seconds, microseconds per record, and the per-record cost
relative to the smallest run side by side (a ratio near 1 means linear).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "core")]

from report_fixtures import write_rl_run  # noqa: E402

from mllm_rl.report import build_report  # noqa: E402
from mllm_rl.report.load import load_run  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--steps", type=int, nargs="+", default=[5, 10, 20, 40])
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    base = None
    print("| steps | records | best s | us/record | per-record vs smallest |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for steps in a.steps:
            run = write_rl_run(
                Path(d) / f"run{steps}", processes=a.processes, steps=steps, kind="cuda", devices=2
            )
            n = sum(len(v) for v in load_run(run).records.values())
            best = float("inf")
            for _ in range(a.repeats):
                t = time.perf_counter()
                if build_report([run]).exit_code != 0:
                    print(f"build_report failed on {run}", file=sys.stderr)
                    return 1
                best = min(best, time.perf_counter() - t)
            per = best / n
            base = base or per
            print(f"| {steps} | {n} | {best:.3f} | {per * 1e6:.0f} | {per / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time ``build_report`` on synthetic runs of growing size (the report must stay linear in records).

    python -m mllm_rl.bench report [--processes 4] [--steps 5 10 20 40] [--repeats 3]

A run per size from the test fixture ``tests/core/report_fixtures.write_rl_run`` (every RL phase,
``--processes`` processes, two CUDA devices each); per size: records, best-of-``--repeats`` seconds,
microseconds per record and the per-record cost over the smallest run's (near 1: linear).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from mllm_rl.bench.machine import ROOT
from mllm_rl.report import build_report
from mllm_rl.report.load import load_run


@functools.cache
def report_fixtures() -> ModuleType:
    """``tests/core/report_fixtures.py`` of the source checkout, loaded from its file."""
    path = ROOT / "tests" / "core" / "report_fixtures.py"
    if not path.is_file():
        raise SystemExit(f"error: {path}: not found (this benchmark needs the source checkout)")
    spec = importlib.util.spec_from_file_location("report_fixtures", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


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
            run = report_fixtures().write_rl_run(
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

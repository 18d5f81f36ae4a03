"""The plan benchmarks' command lines (the plans themselves are benchmarks, docs/PLAN.md):
``--help``, and bad arguments as one line with exit 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT, load_script

SCRIPTS = ["bench_plan_cpu.py", "bench_plan_targets.py", "bench_plan_startup.py"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script):
    r = run(str(ROOT / "scripts" / script), "--help")
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["bench_plan_cpu.py", "--tolerance", "2"],
        ["bench_plan_cpu.py", "--steps", "0"],
        ["bench_plan_targets.py", "--cases", "4b-v9-8"],
        ["bench_plan_startup.py", "--repeats", "0"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(args):
    r = run(str(ROOT / "scripts" / args[0]), *args[1:])
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "error" in r.stderr.strip().splitlines()[-1]


def test_every_target_case_names_a_known_target():
    bench_plan_targets = load_script("bench_plan_targets")

    from mllm_rl.backends.jax.topologies import TARGETS

    for name, (args, expect) in bench_plan_targets.CASES.items():
        assert args[args.index("--target") + 1] in TARGETS, name
        assert expect in ("fits", "report")

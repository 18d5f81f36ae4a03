"""Cheap checks of ``python -m mllm_rl.bench multitask`` (its measured numbers are in docs/BENCHMARKS.md):
``--help``, bad arguments (one line, exit 2), and that its tasks file means what its single runs do."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from mllm_rl.multitask.spec import load_tasks
from tests.conftest import ROOT

BENCH = [sys.executable, "-m", "mllm_rl.bench", "multitask"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*BENCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_help():
    r = run("--help")
    assert r.returncode == 0 and "usage:" in r.stdout and "--tasks" in r.stdout


@pytest.mark.parametrize("args", [["--backend", "xla"], ["--backend", "jax", "--tasks", "0"],
                                  ["--backend", "jax", "--tasks", "9"], ["--backend", "jax", "--steps", "-1"]])  # fmt: skip
def test_bad_arguments_exit_2_with_one_line(args):
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "error" in r.stderr.strip().splitlines()[-1]


def test_the_tasks_file_matches_the_single_runs_settings(tmp_path):
    b = importlib.import_module("mllm_rl.bench.multitask")
    SETTINGS, task_list, tasks_toml = b.SETTINGS, b.task_list, b.tasks_toml

    tasks = task_list(3)
    (tmp_path / "t.toml").write_text(tasks_toml(tasks, SETTINGS))
    specs = load_tasks(tmp_path / "t.toml")
    assert [(s.name, s.seed, s.lr, s.model) for s in specs] == [
        (t["name"], t["seed"], t["lr"], "tiny") for t in tasks
    ]
    for s in specs:
        assert {k: getattr(s, k) for k in SETTINGS} == SETTINGS
    assert len({s.lr for s in specs}) == 3  # the tasks differ

"""``python -m mllm_rl.launch --nproc 2`` runs one JAX run as two processes (the swap plan: a
sglang-jax engine across both processes), each recording its own phases."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import ROOT


@pytest.mark.slow  # starts an engine across two processes
def test_two_processes_of_one_swap_run(tiny_ckpt, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", MLLM_RL_DIST_TIMEOUT_S="120", PYTHONUNBUFFERED="1")
    args = ["--nproc", "2", "--", "--backend", "jax", "--plan", "swap", "--model", str(tiny_ckpt), "--tp", "2",
            "--run-dir", str(tmp_path), "--max-new-tokens", "4", "--wandb", "disabled", "--quiet"]  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "mllm_rl.launch", *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    p0, p1 = read_jsonl(tmp_path / "phases.jsonl"), read_jsonl(tmp_path / "phases.p1.jsonl")
    assert [x["phase"] for x in p0] == [x["phase"] for x in p1]
    assert {x["process_index"] for x in p0} == {0} and {x["process_index"] for x in p1} == {1}
    assert "generate_result" in [x["phase"] for x in p0]


@pytest.mark.slow  # two JAX runtimes come up
def test_an_rl_run_across_processes_is_refused_before_it_starts(tiny_ckpt, tmp_path):
    """sglang-jax cannot pause and release an engine spanning processes yet: the RL plan says so
    once the runtime is up, before a run directory or an engine exists (exit 2 from both)."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", MLLM_RL_DIST_TIMEOUT_S="120", PYTHONUNBUFFERED="1")
    args = ["--nproc", "2", "--grace-s", "60", "--", "--backend", "jax", "--model", str(tiny_ckpt), "--tp", "2",
            "--run-dir", str(tmp_path / "run"), "--wandb", "disabled", "--quiet"]  # fmt: skip
    r = subprocess.run([sys.executable, "-m", "mllm_rl.launch", *args], capture_output=True, text=True, env=env,
                       cwd=ROOT, timeout=600)  # fmt: skip
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [x for x in r.stderr.splitlines() if "error:" in x]
    assert errors and all(
        "2 processes: the jax backend's engine cannot pause and release" in x for x in errors
    )
    assert not (tmp_path / "run").exists()

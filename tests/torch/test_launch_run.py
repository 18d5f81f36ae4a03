"""``python -m mllm_rl.launch --nproc 2`` runs one torch RL run as two data-parallel processes
(``backends/torch/distributed.py``: gloo on CPU, an embedded engine per process, the requests and
the micro-batches split between them, gradients summed): the same metrics as one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # engines in two processes, three runs

# with a bf16 checkpoint, the settings of a pretrained model: mixed precision, LoRA, lr 1e-6, T 0.7
RL = ["--backend", "torch", "--prompts-per-step", "8", "--group-size", "8", "--max-new-tokens", "8",
      "--micro-batch-size", "16", "--checkpoint-every", "1", "--wandb", "disabled", "--console", "off",
      "--lora-rank", "4", "--lr", "1e-6", "--temperature", "0.7"]  # fmt: skip


def launch(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLLM_RL_DIST_TIMEOUT_S": "120", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "mllm_rl.launch", "--nproc", str(nproc), "--grace-s", "30", "--", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)


def test_rl_as_two_data_parallel_processes_is_the_one_process_run(tiny_bf16_ckpt, tmp_path):
    """Each request sampled from its own seed by its index in the whole batch (which process
    generates it does not matter), every process with the whole batch, half of the micro-batches
    each and the gradient summed over both: step 0's rewards equal the one-process run's exactly,
    its loss and grad norm to float32 reduction noise. Later steps (a resume included) may differ
    by a sample or two: the embedded engine's bf16 logits depend on its sub-batch's shape (32 rows
    per process here, 64 in one), so a draw that lands within that noise of a token boundary can
    pick the neighbour token (seen: one of 64 samples at step 2, with the trainer's state after
    step 1 bit-identical in both runs). One checkpoint file per step (process 0 writes it)."""
    one, two = tmp_path / "one", tmp_path / "two"
    r = launch(*RL, "--model", str(tiny_bf16_ckpt), "--steps", "3", "--run-dir", str(one), nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch(*RL, "--model", str(tiny_bf16_ckpt), "--steps", "2", "--run-dir", str(two))
    assert r.returncode == 0, r.stderr[-3000:]
    r = launch(*RL, "--model", str(tiny_bf16_ckpt), "--steps", "3", "--run-dir", str(two), "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    ref = {m["step"]: m for m in read_jsonl(one / "metrics.jsonl")}
    assert any(m["reward_mean"] > 0 for m in ref.values())  # a signal to compare, not all zeros
    for name in ("metrics.jsonl", "metrics.p1.jsonl"):
        got = {m["step"]: m for m in read_jsonl(two / name)}
        assert sorted(got) == [0, 1, 2], name
        assert got[0]["reward_mean"] == ref[0]["reward_mean"], name
        assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=1e-4, abs=1e-6), name
        assert got[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=1e-4, abs=1e-6), name
        for s in (1, 2):  # at most two of the 64 samples (rewards in [0, 1]) drawn differently
            assert abs(got[s]["reward_mean"] - ref[s]["reward_mean"]) <= 2 / 64, (name, s)
    p0, p1 = read_jsonl(two / "phases.jsonl"), read_jsonl(two / "phases.p1.jsonl")
    assert [x["phase"] for x in p0] == [x["phase"] for x in p1] and "train_step" in [x["phase"] for x in p0]
    assert [p.name for p in sorted((two / "checkpoints" / "step_000002").iterdir())] == [
        "meta.json",
        "state.pt",
    ]

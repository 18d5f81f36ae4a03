"""``python -m mllm_rl.launch --nproc 2`` runs one JAX RL run as two processes (a sglang-jax engine
and the trainer's mesh across both processes), each recording its own phases. The launched swap run
is ``tests/jax/test_multihost.py``'s shared run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import ROOT, without_device_count

RL = ["--backend", "jax", "--tp", "2", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4",
      "--checkpoint-every", "1", "--wandb", "disabled", "--console", "off"]  # fmt: skip
# what a user of a pretrained model runs: a bf16 checkpoint (mixed precision), LoRA, a fine-tuning
# learning rate, temperature below 1
REAL = ["--lora-rank", "4", "--lr", "1e-6", "--temperature", "0.7"]


def launch(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = without_device_count()
    env.update(JAX_PLATFORMS="cpu", MLLM_RL_DIST_TIMEOUT_S="120", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "mllm_rl.launch", "--nproc", str(nproc), "--grace-s", "30", "--", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)


def by_step(run_dir, name="metrics.jsonl") -> dict[int, dict]:
    return {m["step"]: m for m in read_jsonl(run_dir / name)}


@pytest.mark.slow  # engines across two processes, three runs
def test_rl_across_two_processes_killed_mid_step_resumes_to_the_one_process_run(tiny_bf16_ckpt, tmp_path):
    """``--plan rl`` as two processes (one sglang-jax engine and one (fsdp, tp) trainer mesh over
    both processes' devices, weights-cpu-backup on), at the settings of a pretrained model (bf16
    checkpoint, LoRA, lr 1e-6, temperature 0.7). Process 1 is SIGKILLed during step 1: the launcher
    stops process 0 (SIGTERM, its run closes its logs) and exits 137 (128 + SIGKILL, the first
    failure) within the grace period; no process of the run is left. ``--resume`` continues both
    processes from step 0's orbax checkpoint to the end, and the whole run gives the metrics of the
    same run as one process with as many devices: rewards exactly, loss and grad norm to float32
    reduction noise."""
    from tests.launch_kill import kill_process_1_in_step_1

    one, two, model = tmp_path / "one", tmp_path / "two", str(tiny_bf16_ckpt)
    r = launch(*RL, *REAL, "--model", model, "--steps", "3", "--run-dir", str(one), nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    env = without_device_count()
    env.update(JAX_PLATFORMS="cpu", MLLM_RL_DIST_TIMEOUT_S="120", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "mllm_rl.launch", "--nproc", "2", "--grace-s", "20", "--", *RL, *REAL,
           "--model", model, "--steps", "3", "--weights-cpu-backup", "--run-dir", str(two)]  # fmt: skip
    kill_process_1_in_step_1(cmd, env, two)
    # the resume takes the settings run.json recorded
    r = launch(*RL, "--model", model, "--steps", "3", "--weights-cpu-backup", "--run-dir", str(two),
               "--resume")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[p1] resume: from " in r.stderr and "[p0] resume: from " in r.stderr
    ref = by_step(one)
    for name in ("metrics.jsonl", "metrics.p1.jsonl"):  # every process trained on the same batches
        assert [m["step"] for m in read_jsonl(two / name)][-2:] == [1, 2], name  # step 1 again, then 2
        got = by_step(two, name)
        assert sorted(got) == [0, 1, 2]
        for s in (0, 1, 2):
            assert got[s]["reward_mean"] == ref[s]["reward_mean"], (name, s)
            assert got[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=1e-4, abs=1e-6), (name, s)
            assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=1e-4, abs=1e-6), (name, s)
    p0, p1 = read_jsonl(two / "phases.jsonl"), read_jsonl(two / "phases.p1.jsonl")
    starts = [i for i, x in enumerate(p0) if x["phase"] == "wandb_init"]
    assert len(starts) == 2  # the killed run and the resumed one
    resumed_p0 = [x["phase"] for x in p0[starts[1] :]]
    resumed_p1 = [x["phase"] for x in p1[[x["phase"] for x in p1].index("wandb_init", 1) :]]
    assert resumed_p0 == resumed_p1 and "train_step" in resumed_p0
    assert sorted(x.name for x in (two / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    summary = json.loads((two / "report" / "summary.json").read_text())
    bad = [i for i in summary["issues"] if i["severity"] == "error"]
    assert bad == [], bad

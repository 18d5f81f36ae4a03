"""The per-phase watchdog: a phase past its limit is recorded as stuck, every thread's stack is dumped
into the run directory, and the run exits 6 instead of hanging.

The hangs are injected with ``mllm_rl.faults`` (``hang=PHASE``: a sleep the watchdog's interrupt
ends; ``hang_deaf=PHASE``: a sleep that swallows it, like a hang inside C code, which only the hard
exit ends) into ``wandb_init``, the first phase of a whole run on the fake backend
(``tests/fake_run.py``): the watchdog, the recorder, the report and the exit are the product's, and
the run starts in about a second instead of bringing a framework up. The same in ``train_step``
with a real engine (its threads in the dump): tests/jax/test_rl_run.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from mllm_rl.phases.watchdog import DEFAULT_LIMIT_S, LIGHT_FACTOR, PhaseLimits
from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import ROOT


def test_limits_scale_with_what_the_phase_does():
    lim = PhaseLimits()
    assert lim.limit("train_step") == lim.limit("engine_ready_dummy") == DEFAULT_LIMIT_S
    assert lim.limit("release_rollout") == lim.limit("empty_cache") == DEFAULT_LIMIT_S * LIGHT_FACTOR
    lim = PhaseLimits.parse(["600", "train_step=3600", "rollout=0"])
    assert (lim.limit("train_step"), lim.limit("rollout"), lim.limit("checkpoint")) == (3600, None, 600)
    assert PhaseLimits.parse(["0"]).limit("train_step") is None
    assert PhaseLimits.parse(["0", "drain=5"]).limit("drain") == 5


@pytest.mark.parametrize("spec", ["abc", "-1", "nan", "inf", "=5", "train_step=", "train_step=x"])
def test_bad_limits_are_refused(spec):
    with pytest.raises(ValueError, match="--phase-timeout"):
        PhaseLimits.parse([spec])


def run_hanging(tmp_path, fault: str) -> tuple[subprocess.CompletedProcess, float]:
    pytest.importorskip("transformers", reason="a run renders its prompts with the model's tokenizer")
    cmd = [sys.executable, "-m", "tests.fake_run", "--backend", "fake", "--run-dir", str(tmp_path / "run"), "--quiet",
           "--wandb", "disabled", "--phase-timeout", "wandb_init=2", "--platform", "cpu"]  # fmt: skip
    env = {**__import__("os").environ, "MLLM_RL_FAULTS": fault, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    return r, time.monotonic() - t0


@pytest.mark.slow  # a whole run (on the fake backend)
@pytest.mark.parametrize("fault,hard", [("hang=wandb_init", False), ("hang_deaf=wandb_init", True)])
def test_a_stuck_phase_is_recorded_dumped_and_ends_the_run_with_exit_6(tmp_path, fault, hard):
    r, seconds = run_hanging(tmp_path, fault)
    run = tmp_path / "run"
    assert r.returncode == 6, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert seconds < 120  # 2 s limit, then at most the 5 s grace (hard exit) + the report
    assert ("did not stop within" in r.stderr) == hard
    (stacks,) = run.glob("stuck-*.txt")
    assert stacks.name == "stuck-wandb_init-p0.txt"
    dump = stacks.read_text()
    assert "phase wandb_init still running after its 2 s limit" in dump
    assert "MainThread" in dump and "injected_hang" in dump  # where the main thread sits
    assert "mllm_rl-watchdog" in dump and "faulthandler.dump_traceback" in dump
    (rec,) = read_jsonl(run / "phases.jsonl")
    assert rec["phase"] == "wandb_init" and rec["info"]["stuck"] == {"limit_s": 2.0, "stacks": str(stacks)}
    assert rec["info"]["error"].startswith("PhaseStuck: phase wandb_init stuck")
    assert rec["t_end"] - rec["t_start"] >= 2.0
    summary = json.loads((run / "report" / "summary.json").read_text())
    kinds = [i["kind"] for i in summary["issues"] if i["severity"] == "error"]
    assert "stuck_phase" in kinds and "phase_error" not in kinds
    # --quiet: only errors on stderr
    assert all(line.startswith(("error:", "report: error:")) for line in r.stderr.strip().splitlines()), (
        r.stderr
    )

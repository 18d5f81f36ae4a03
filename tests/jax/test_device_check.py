"""The device check's CPU mode (``scripts/device_check.sh --cpu``): every step of the GPU check on
the tiny model, the JAX steps on the JAX that accelerator images ship (``.venv-jax-next``: jax
0.11.2, transformers 5, flax 0.12.12 and sglang-jax without its pins, as the check carries them to
an offline GPU machine). It is the CI run of the JAX backend on that JAX: the swap, a 2-step RL run
and its ``--resume`` for a third (on 0.11 the step-1 ``train_step`` once hung on the memory
sampler's live-array scan), and it keeps the script from rotting where no GPU is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    out = tmp_path_factory.mktemp("device-check")
    p = subprocess.run(
        ["bash", "scripts/device_check.sh", "--cpu", "--out", str(out), "--budget", "900"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    doc = json.loads((out / "device_check.json").read_text())
    return p, doc, out


@pytest.mark.slow
def test_every_step_of_the_cpu_mode_passes(check):
    p, doc, out = check
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    names = [s["name"] for s in doc["steps"]]
    assert names == [
        "env",
        "copy-jax",
        "swap-jax",
        "rl-jax",
        "copy-torch",
        "rl-torch",
        "engine-torch",
        "engine-jax",
    ]
    assert all(s["rc"] == 0 for s in doc["steps"]), [(s["name"], s.get("error")) for s in doc["steps"]]
    md = (out / "device_check.md").read_text()
    assert "| rl-jax | 0 |" in md and "## rl-torch: phases of the last step" in md
    assert ("with changes to its files" in md) == doc["machine"]["git"]["dirty"]


@pytest.mark.slow
def test_the_jax_steps_ran_on_the_next_jax_with_native_attention(check):
    _, doc, _ = check
    env = doc["steps"][0]["result"]
    assert env["packages"]["jax"].startswith("0.11."), env
    assert env["packages"]["transformers"].startswith("5."), env
    assert env["sglang_jax_attention_backend"] == "native"


@pytest.mark.slow
def test_the_runs_moved_weights_and_held_to_their_plans(check):
    _, doc, out = check
    res = {s["name"]: s["result"] for s in doc["steps"]}
    assert res["swap-jax"]["weights_swapped_gbps"] > 0
    assert res["rl-jax"]["steps"] == 3  # 2, then --resume for a third
    assert "resume_cmd" in doc["steps"][3]
    for name in ("rl-jax", "rl-torch"):
        assert res[name]["update_weights_gbps"] > 0
        assert res[name]["plan_drifts"] == [], res[name]["plan_audit"]
        assert {r["source"] for r in res[name]["phases"] if r["source"]} <= {"live_arrays", "live_tensors"}
        # the last attempt's phases: rl-jax's resumed run, not its first run's setup as well
        assert [r["phase"] for r in res[name]["phases"]].count("setup:wandb_init") == 1, name
        # the step's share as bench step-cost reads it: step 1 (each attempt's first compiles), which saved
        assert res[name]["steps_counted"] == [1], name
        assert 0 < res[name]["other_share_at_cadence"] < res[name]["other_share_median"] < 1, name
    assert "non-rollout, non-train " in (out / "device_check.md").read_text()
    assert set(doc["copy"]) == {"jax", "torch"} and doc["copy"]["jax"]["h2d_gbps"] > 0
    engines = {r["engine"] for n in ("engine-torch", "engine-jax") for r in res[n]["rows"]}
    assert engines == {"embedded", "hf", "sglang-jax"}


@pytest.mark.parametrize(
    "args, says",
    [
        (["--budget", "5"], "--budget 5.0: must exceed"),
        (["--only", "nothing"], "--only nothing: selects no step"),
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, args, says):
    p = subprocess.run(
        [sys.executable, "scripts/device_check.py", "--cpu", "--out", str(tmp_path / "o"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2 and says in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()


def test_a_failed_steps_line_is_the_runs_error_not_the_cuda_clients_unload_lines():
    """What the check says of a failed run: its ``error:`` line, found under XLA's repeated
    'Failed to unload module' blocks; else the last lines that are not that noise."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("device_check", ROOT / "scripts" / "device_check.py")
    dc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dc)
    unload = "E1130 cuda_executor.cc:313] [0] Failed to unload module 0x1; leaking: INTERNAL: CUDA error\n"
    run = "phase 11 rollout ERROR\nerror: EngineThreadError: the cause\n" + unload * 50 + "report written\n"
    assert dc.failure_line(run) == "error: EngineThreadError: the cause"
    assert dc.failure_line("a\nb\n\nc\nd\n" + unload * 50) == "b | c | d"

"""The run plans its own memory before start-up (JAX CPU): a configuration that cannot fit exits 6
before anything exists, ``--kv-tokens auto`` starts the engine with the plan's pool, every run dir
has ``plan.json``, and a deliberate leak is a finding while a clean run has none."""

from __future__ import annotations

import json

import pytest

from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli

SMALL = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4",
         "--max-running-requests", "4", "--checkpoint-every", "0", "--wandb", "disabled", "--console", "off"]  # fmt: skip


def run(tiny_ckpt, run_dir, *extra, env=None):
    return run_cli("mllm_rl.run", "--backend", "jax", "--model", str(tiny_ckpt), "--run-dir", str(run_dir),
                   *SMALL, *extra, env=env, timeout=900)  # fmt: skip


def drift(run_dir) -> list[dict]:
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    return [i for i in summary["issues"] if i["kind"] == "plan_drift"]


@pytest.mark.slow  # compiles the trainer's step for the plan
def test_a_pool_that_cannot_fit_exits_6_before_anything_exists(tiny_ckpt, tmp_path):
    r = run(tiny_ckpt, tmp_path / "run", "--kv-tokens", "1000000000")
    assert r.returncode == 6, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: memory plan (cpu, predicted): multi_stage: DOES NOT FIT: kv_pool overflows in"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # starts an engine
def test_a_clean_run_holds_to_its_plan_and_a_leak_does_not(tiny_ckpt, tmp_path):
    clean = tmp_path / "clean"
    r = run(tiny_ckpt, clean)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((clean / "plan.json").read_text())
    assert plan["kind"] == "predicted" and plan["for_run"] is True
    said = [x for x in r.stderr.splitlines() if x.startswith("memory plan:")]
    assert said and "ended within 5% of the prediction or below it" in said[0], said
    assert drift(clean) == []
    assert "Memory plan vs run" in r.stderr and " DRIFT" not in r.stderr  # the console table

    leaky = tmp_path / "leaky"  # with W&B offline: the plan table and the drift count land there too
    r = run(tiny_ckpt, leaky, "--wandb", "offline", env={"MLLM_RL_FAULTS": "leak_mb=64"})
    assert r.returncode == 0, r.stderr[-3000:]
    found = drift(leaky)
    assert found and all(i["severity"] == "warning" for i in found)
    assert any("train_step" in i["message"] or "checkpoint" in i["message"] for i in found)
    table = [x for x in r.stderr.splitlines() if x.startswith("train_step ")]
    assert table and table[0].rstrip().endswith("DRIFT"), table  # the plan table comes first
    from tests.core.test_report_wandb import _summary_items

    (run_file,) = leaky.glob("wandb/offline-run-*/run-*.wandb")
    summary = _summary_items(run_file)
    assert summary["report/plan_drifts"] == len(found) and summary["report/plan_phases"] >= 20


@pytest.mark.slow  # starts an engine
def test_kv_tokens_auto_starts_the_engine_with_the_plans_pool(tiny_ckpt, tmp_path):
    # a budget of 3% of the host's RAM: the CPU engine allocates (and zeroes) the pool it is given
    r = run(tiny_ckpt, tmp_path, "--kv-tokens", "auto", "--margin", "0.03", "--steps", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((tmp_path / "plan.json").read_text())
    tokens = plan["kv_fit"]["tokens"]
    (ready,) = [x for x in read_jsonl(tmp_path / "phases.jsonl") if x["phase"] == "engine_ready_dummy"]
    assert ready["info"]["max_total_tokens"] == tokens > 0
    assert f"--kv-tokens auto: a KV pool of {tokens} tokens" in r.stderr

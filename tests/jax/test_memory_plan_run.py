"""The run plans its own memory before start-up (JAX CPU): a configuration that cannot fit exits 6
before anything exists, ``--kv-tokens auto`` starts the engine with the plan's pool, every run dir
has ``plan.json``, and a deliberate leak is a finding while a clean run has none."""

from __future__ import annotations

import json

import pytest

from tests import plan_run
from tests.plan_run import drift

FIVE_STEPS = ("--steps", "5")  # the host-growth check needs steps 1-4


def host_growth(run_dir) -> list[dict]:
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    return [i for i in summary["issues"] if i["kind"] == "host_growth"]


def run(tiny_ckpt, run_dir, *extra, env=None):
    return plan_run.run("jax", tiny_ckpt, run_dir, *extra, env=env)


@pytest.mark.slow  # compiles the trainer's step for the plan
def test_a_pool_that_cannot_fit_exits_6_before_anything_exists(tiny_ckpt, tmp_path):
    plan_run.check_a_pool_that_cannot_fit_exits_6_before_anything_exists("jax", tiny_ckpt, tmp_path)


@pytest.mark.slow  # starts an engine
def test_a_clean_run_holds_to_its_plan_and_a_leak_does_not(tiny_ckpt, tiny_bf16_ckpt, tmp_path):
    """The clean run at a pretrained model's settings: a bf16 checkpoint (float32 masters), LoRA
    rank 4, lr 1e-6, temperature 0.7. The leaky one also keeps 64 MiB of host memory per train
    step: the report's host_growth finds it, and not in the clean run."""
    clean = tmp_path / "clean"
    r = run(tiny_bf16_ckpt, clean, "--lora-rank", "4", "--lr", "1e-6", "--temperature", "0.7", *FIVE_STEPS)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((clean / "plan.json").read_text())
    assert plan["kind"] == "predicted" and plan["for_run"] is True
    said = [x for x in r.stderr.splitlines() if x.startswith("memory plan:")]
    assert said and "ended within 5% of the prediction or below it" in said[0], said
    assert drift(clean) == [] and host_growth(clean) == []
    assert "Memory plan vs run" in r.stderr and " DRIFT" not in r.stderr  # the console table
    # host memory: the trainer's offloaded params and AdamW state in pinned_host at every phase end
    # of the last step and the setup are the plan's host copies, byte for byte
    from mllm_rl.memplan import audit

    rows = audit.compare(audit.load_records(clean), plan)["phases"]
    host = [(row["phase"], row["host_trainer_predicted"], row["host_trainer_measured"]) for row in rows]
    assert len(host) >= 20 and all(pred == got for _, pred, got in host), host
    assert {pred for _, pred, _ in host} > {0}  # offloaded in some phases, on the device in others
    assert "host (host copies and the CPU devices' bytes, per host): peak" in r.stderr

    leaky = tmp_path / "leaky"  # with W&B offline: the plan table and the drift count land there too
    r = run(
        tiny_ckpt,
        leaky,
        "--wandb",
        "offline",
        *FIVE_STEPS,
        env={"MLLM_RL_FAULTS": "leak_mb=64,host_leak_mb=64"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    (grew,) = host_growth(leaky)  # 64 MiB of host memory kept per train step, and on CPU the device
    # leak's 64 MiB are host RAM too
    assert grew["severity"] == "warning" and "from step 1 to step 4" in grew["message"], grew
    assert 120 < float(grew["message"].split("grew ")[1].split(" MiB")[0]) < 150, grew
    found = drift(leaky)
    assert found and all(i["severity"] == "warning" for i in found)
    assert any("train_step" in i["message"] or "checkpoint" in i["message"] for i in found)
    table = [x for x in r.stderr.splitlines() if x.startswith("train_step ")]
    assert table and table[0].rstrip().endswith("DRIFT"), table  # the plan table comes first
    from tests.core.test_report_wandb import _summary_items

    (run_file,) = leaky.glob("wandb/offline-run-*/run-*.wandb")
    summary = _summary_items(run_file)
    assert summary["report/plan_drifts"] == len(found) and summary["report/plan_phases"] >= 20


@pytest.fixture(scope="module")
def host_opt(tiny_bf16_ckpt, tmp_path_factory):
    """One run for two tests: the optimizer in host memory, its engine's KV pool by ``--kv-tokens auto``
    (the plan of a host-optimizer run sizes the pool like any other)."""
    out = tmp_path_factory.mktemp("host-opt")
    r = run(
        tiny_bf16_ckpt,
        out,
        *("--lr", "1e-6", "--temperature", "0.7", "--kv-tokens", "auto"),
        *("--model-option", "optimizer_memory=host", "--model-option", "scan_layers=true"),
        *("--model-option", "remat=block"),
    )
    return r, out


@pytest.mark.slow  # starts an engine
def test_kv_tokens_auto_starts_the_engine_with_the_plans_pool(host_opt):
    """At the default margin: on CPU the plan's budget is a share of the RAM available now, and the
    fitted pool is capped at what the run can hold at once (``tests/plan_run.py``)."""
    plan_run.check_kv_tokens_auto_pool(*host_opt)


@pytest.mark.slow  # starts an engine
def test_a_run_with_the_optimizer_in_host_memory_holds_to_its_plan(host_opt):
    """``--model-option optimizer_memory=host`` on the TPU model path (stacked layers, remat), a
    bf16 checkpoint's full fine-tune at lr 1e-6, temperature 0.7: the plan keeps the AdamW state on
    the host in every phase from the trainer's start on and no device row holds it, the run's
    phases end at the plan, and the pinned_host arrays at every phase end are the plan's host
    copies byte for byte (the state included, never on the device)."""
    r, out = host_opt
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((out / "plan.json").read_text())
    main = plan["plans"][plan["schedule"]]
    assert main["components"]["optimizer"]["memory"] == "host"
    opt = main["components"]["optimizer"]["bytes_per_device"]
    assert opt > 0 and all("optimizer" not in p["resident"] for p in main["phases"])
    trainer_phases = [p for p in main["phases"] if p["phase"] not in ("setup:release_rollout",)]
    assert all(p["host"].get("optimizer") == opt for p in trainer_phases), trainer_phases
    assert drift(out) == []
    from mllm_rl.memplan import audit

    rows = audit.compare(audit.load_records(out), plan)["phases"]
    host = [(row["phase"], row["host_trainer_predicted"], row["host_trainer_measured"]) for row in rows]
    assert len(host) >= 20 and all(pred == got for _, pred, got in host), host
    assert all(pred >= opt for phase, pred, _ in host if phase != "setup:release_rollout"), host

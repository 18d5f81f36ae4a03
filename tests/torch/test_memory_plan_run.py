"""The torch run plans its own memory before start-up (on CPU here; on CUDA the same code against the
card): the plan is the embedded engine and the trainer the run starts, a configuration that cannot
fit exits 6 before anything exists, every run dir has ``plan.json`` that the phases hold to, at a
pretrained model's settings too, and a deliberate leak is a finding."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mllm_rl.backends.torch import memplan
from mllm_rl.checkpoint import ModelDir
from mllm_rl.memplan import audit
from mllm_rl.memplan.request import PlanRequest
from tests import plan_run
from tests.plan_run import drift


def run(ckpt, run_dir, *extra, env=None):
    return plan_run.run("torch", ckpt, run_dir, *extra, env=env)


def test_the_cpu_plan_is_the_embedded_engine_the_run_starts(tiny_ckpt):
    """Target ``cpu`` plans the embedded engine (auto there): its weights and KV pool equal what a
    real ``EmbeddedEngine`` holds, byte for byte; SGLang on cpu and a JAX plan of the embedded
    engine are refused in one line."""
    from mllm_rl.backends.torch.engine import EmbeddedEngine

    model = ModelDir.open(tiny_ckpt)
    req = PlanRequest(backend="torch", target="cpu", model=model.config, micro_batch=2, seq_len=64,
                      prompts=2, group_size=2, kv_tokens=1000, param_dtype=model.config.torch_dtype)  # fmt: skip
    m = memplan.measure(req)
    eng = EmbeddedEngine(model, device="cpu", max_total_tokens=1000, context_length=64)
    try:
        assert (
            m.components["engine_weights"].bytes_per_device == eng.weight_bytes() == eng.tag_bytes("weights")
        )
        assert m.components["kv_pool"].bytes_per_device == eng.tag_bytes("kv_cache")
    finally:
        eng.shutdown()
    assert m.target.platform == "cpu" and m.info["engine"] == "embedded" and m.info["kv_pad_tokens"] == 0
    with pytest.raises(ValueError, match="SGLang runs on CUDA"):
        memplan.measure(dataclasses.replace(req, engine="sglang"))
    with pytest.raises(ValueError, match="PlanRequest.engine 'nope'"):
        dataclasses.replace(req, engine="nope")


@pytest.mark.slow  # plans before start-up (fake-tensor trace), nothing starts
def test_a_pool_that_cannot_fit_exits_6_before_anything_exists(tiny_ckpt, tmp_path):
    plan_run.check_a_pool_that_cannot_fit_exits_6_before_anything_exists("torch", tiny_ckpt, tmp_path)


@pytest.mark.slow  # starts an engine
def test_a_run_at_real_settings_holds_to_its_plan_and_a_leak_does_not(tiny_bf16_ckpt, tmp_path):
    """A bf16 checkpoint (float32 masters), LoRA rank 4, lr 1e-6, temperature 0.7: ``plan.json`` is
    the cpu target's embedded engine, every phase's end within 5% of it (``audit.compare``) and
    no drift; with the ``leak_mb`` fault the train step's phases drift."""
    real = ["--lora-rank", "4", "--lr", "1e-6", "--temperature", "0.7"]
    clean = tmp_path / "clean"
    r = run(tiny_bf16_ckpt, clean, *real)
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((clean / "plan.json").read_text())
    assert plan["kind"] == "predicted" and plan["for_run"] is True
    run_plan = plan["plans"][plan["schedule"]]
    assert (
        run_plan["target"]["name"] == "cpu"
        and "embedded engine" in run_plan["components"]["kv_pool"]["detail"]
    )
    said = [x for x in r.stderr.splitlines() if x.startswith("memory plan:")]
    assert said and "ended within 5% of the prediction or below it" in said[0], said
    assert drift(clean) == []
    held = audit.compare(audit.load_records(clean), plan)
    assert held["within"], [row for row in held["components"] + held["phases"] if not row["within"]]
    assert len(held["phases"]) >= 20

    leaky = tmp_path / "leaky"
    r = run(tiny_bf16_ckpt, leaky, *real, env={"MLLM_RL_FAULTS": "leak_mb=64"})
    assert r.returncode == 0, r.stderr[-3000:]
    found = drift(leaky)
    assert found and any("train_step" in i["message"] or "checkpoint" in i["message"] for i in found)


@pytest.mark.slow  # starts an engine
def test_kv_tokens_auto_starts_the_engine_with_the_plans_pool(tiny_ckpt, tmp_path):
    plan_run.check_kv_tokens_auto_starts_the_engine_with_the_plans_pool("torch", tiny_ckpt, tmp_path)


def test_which_runs_plan_themselves():
    """One process on CPU (both backends) or torch on CUDA: planned; torch over N processes of this
    machine: planned for ``cpuxN`` / ``cudaxN``; a JAX GPU or TPU whose runtime names no device kind:
    not (the run says so in one line). (JAX on a TPU slice or an NVIDIA node:
    tests/jax/test_run_plan_target.py.)"""
    from mllm_rl.memplan.for_run import target_for

    assert target_for("jax", {"platform": "cpu"}) == target_for("torch", {"platform": "cpu"}) == "cpu"
    assert target_for("torch", {"platform": "cuda", "process_count": 1}) == "cuda"
    assert target_for("jax", {"platform": "gpu"}) is target_for("jax", {"platform": "tpu"}) is None
    assert target_for("torch", {"platform": "cpu", "process_count": 2}) == "cpux2"

"""``python -m mllm_rl.run --backend jax --tasks FILE``: two RL tasks (different model sizes, seeds,
learning rates, one with LoRA) on real sglang-jax engines and flax trainers in one process (JAX CPU).

Each run is a subprocess (an sglang-jax engine must not live in pytest's process). A task that
fails, stops alone and is resumed: on the fake backend, tests/core/test_multitask_fake_run.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from mllm_rl.phases import validate_record
from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli

pytestmark = pytest.mark.slow
# 8 prompts x 8 samples x 8 tokens: enough that both tiny models earn non-zero rewards (equal zeros prove nothing)
SMALL = {"steps": 2, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 8, "max_running_requests": 64,
         "checkpoint_every": 1}  # fmt: skip
TASKS = {"a": {"seed": 0, "lr": 3e-3}, "b": {"seed": 1, "lr": 1e-3, "lora_rank": 4}}
MIB = 2**20


def toml(models: dict[str, Path], tasks: dict[str, dict] = TASKS) -> str:
    lines = ["[defaults]", *(f"{k} = {v}" for k, v in SMALL.items())]
    for name, kw in tasks.items():
        lines += ["", "[[task]]", f'name = "{name}"', f'model = "{models[name]}"']
        lines += [f"{k} = {v}" for k, v in kw.items()]
    return "\n".join(lines) + "\n"


def single_args(model: Path, run_dir: Path, seed: int, lr: float, lora_rank: int = 0) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    return ["mllm_rl.run", "--backend", "jax", "--model", str(model), "--seed", str(seed), "--lr", str(lr),
            "--lora-rank", str(lora_rank), "--run-dir", str(run_dir), "--wandb", "disabled", "--console", "off",
            *flags]  # fmt: skip


@pytest.fixture(scope="module")
def models(tiny_ckpt, tmp_path_factory) -> dict[str, Path]:
    """Task b's model is bigger: the tiny preset with 3 layers instead of 2."""
    from mllm_rl.checkpoint import make_checkpoint
    from mllm_rl.presets import get_preset

    cfg = dataclasses.replace(get_preset("tiny"), name="tiny-3l", num_hidden_layers=3)
    bigger = make_checkpoint(cfg, tmp_path_factory.mktemp("ckpt3") / "tiny3", seed=1, show_progress=False)
    return {"a": tiny_ckpt, "b": bigger}


def multi_run(run_dir: Path, models: dict[str, Path], *extra: str, env: dict[str, str] | None = None,
              tasks: dict[str, dict] = TASKS):  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir.parent / f"{run_dir.name}.toml").write_text(toml(models, tasks))
    return run_cli("mllm_rl.run", "--backend", "jax", "--tasks", str(run_dir.parent / f"{run_dir.name}.toml"),
                   "--run-dir", str(run_dir), "--console", "off", *extra, env=env, timeout=900)  # fmt: skip


@pytest.fixture(scope="module")
def two_tasks(models, tmp_path_factory):
    base = tmp_path_factory.mktemp("multitask")
    r = multi_run(base / "multi", models, "--wandb", "offline")
    singles = {}
    for name, kw in TASKS.items():
        d = base / f"single_{name}"
        s = run_cli(*single_args(models[name], d, kw["seed"], kw["lr"], kw.get("lora_rank", 0)), timeout=900)
        assert s.returncode == 0, s.stderr[-3000:]
        singles[name] = read_jsonl(d / "metrics.jsonl")
    return r, base / "multi", singles


def test_two_tasks_run_to_the_end_and_every_record_names_its_task(two_tasks):
    r, run_dir, _ = two_tasks
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((run_dir / "run.json").read_text())
    assert {n: t["status"] for n, t in plan["tasks"].items()} == {"a": "done", "b": "done"}
    recs = read_jsonl(run_dir / "phases.jsonl")
    for x in recs:
        validate_record(x)
        assert x["schema"] == "mllm_rl.phase/2" and "error" not in x["info"]
    assert {x["task"] for x in recs} == {None, "a", "b"}
    for name, t in plan["tasks"].items():
        mine = [x for x in recs if x["task"] == name]
        assert [x["phase"] for x in mine if x["step"] is None] == t["expected_phases"]
        for s in range(SMALL["steps"]):
            assert [x["phase"] for x in mine if x["step"] == s] == t["expected_step_phases"]
        for x in mine:
            if x["phase"] == "release_rollout" and x["step"] is not None:
                assert set(x["info"]["held"]) == {f"{name}/weights", f"{name}/kv_cache"}
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["counts"]["error"] == 0, summary["issues"]


def test_each_task_rewards_equal_its_single_task_run(two_tasks):
    r, run_dir, singles = two_tasks
    assert r.returncode == 0, r.stderr[-3000:]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    for name in TASKS:
        mine = sorted((x for x in rows if x["task"] == name), key=lambda x: x["step"])
        alone = singles[name]
        assert [x["step"] for x in mine] == [x["step"] for x in alone] == list(range(SMALL["steps"]))
        assert [x["reward_mean"] for x in mine] == [x["reward_mean"] for x in alone], name
        for key in ("loss", "grad_norm", "completion_len_mean"):
            np.testing.assert_allclose([x[key] for x in mine], [x[key] for x in alone], rtol=1e-5, atol=1e-7)
        assert any(x["reward_mean"] > 0 for x in mine) and any(x["grad_norm"] > 0 for x in mine), name
    # the tasks really differ (different models, seeds, lr): equal curves would prove nothing
    a = [x["grad_norm"] for x in rows if x["task"] == "a"]
    b = [x["grad_norm"] for x in rows if x["task"] == "b"]
    assert a != b


def test_between_leases_the_device_is_back_at_the_baseline(two_tasks):
    _, run_dir, _ = two_tasks
    leases = read_jsonl(run_dir / "leases.jsonl")
    kinds = [(x["task"], x["kind"], x["step"]) for x in leases]
    assert kinds[:2] == [("a", "setup", None), ("b", "setup", None)] and kinds[-1] == ("b", "final", None)
    assert all(x["outcomes"] == ["ok"] for x in leases)
    baseline = leases[1]["device_bytes"]  # after every task's start-up
    assert baseline is not None and baseline < MIB
    assert all(abs(x["device_bytes"] - baseline) <= MIB for x in leases[2:])
    recs = read_jsonl(run_dir / "phases.jsonl")
    peaks = [
        sum(d["phase_peak_bytes"] for d in x["memory"]["devices"]) for x in recs if x["step"] is not None
    ]
    assert max(peaks) > 4 * MIB  # the leases themselves do hold the model (the check above is not vacuous)


def test_wandb_has_one_point_per_step_per_task(two_tasks):
    from mllm_rl.sinks.wandb_file import read_history

    _, run_dir, _ = two_tasks
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = read_history(run_file)
    for name in TASKS:
        mine = [x for x in rows if f"{name}/train/reward_mean" in x]
        assert [x[f"{name}/rl/step"] for x in mine] == list(range(SMALL["steps"]))

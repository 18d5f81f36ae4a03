"""``python -m mllm_rl.run --tasks FILE``: whole runs on the fake backend (``python -m tests.fake_run
--backend fake``, ``tests/fake_backend.py``): a task failing, and a task of the user's own.

The task's failure, its release on fault, the other task going on, the lease log, run.json's task
statuses, the report and the resume of the failed task alone are the multi-task driver's and the
core's (``mllm_rl.multitask``), the same for every backend; the fault is injected in the core
(``checkpoint_fails:TASK:STEP``). Real engines and trainers in a multi-task run (each task equal to
its run alone, the device back at its baseline between leases): tests/jax/test_multitask_run.py,
tests/torch/test_multitask_run.py.

A task of a tasks file with the user's data and reward file, named relative to the file: how the
file is read, the reward worker and each task's rewards.jsonl are the core's; the same task on the
torch backend's real engine: tests/torch/test_byo_task.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mllm_rl.sinks.jsonl import read_jsonl
from tests.byo_task import tasks_file_takes_a_dataset_and_a_reward_file
from tests.conftest import run_cli

SMALL = {"steps": 2, "prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4, "max_running_requests": 8,
         "checkpoint_every": 1}  # fmt: skip
TASKS = {"a": {"seed": 0, "lr": 3e-3, "steps": 3}, "b": {"seed": 1, "lr": 1e-3, "lora_rank": 4}}
MIB = 2**20


def toml(model: Path, tasks: dict[str, dict]) -> str:
    lines = ["[defaults]", *(f"{k} = {v}" for k, v in SMALL.items())]
    for name, kw in tasks.items():
        lines += [
            "",
            "[[task]]",
            f'name = "{name}"',
            f'model = "{model}"',
            *(f"{k} = {v}" for k, v in kw.items()),
        ]
    return "\n".join(lines) + "\n"


def multi_run(run_dir: Path, model: Path, *extra: str, env: dict[str, str] | None = None):
    run_dir.mkdir(parents=True, exist_ok=True)
    tasks_file = run_dir.parent / f"{run_dir.name}.toml"
    tasks_file.write_text(toml(model, TASKS))
    return run_cli("tests.fake_run", "--backend", "fake", "--tasks", str(tasks_file), "--run-dir", str(run_dir),
                   "--console", "off", "--wandb", "disabled", *extra, env=env, timeout=300)  # fmt: skip


@pytest.mark.slow  # whole runs (on the fake backend)
def test_a_failing_task_stops_alone_and_resume_finishes_it(tiny_ckpt, tmp_path):
    """b's checkpoint of step 1 fails (in its train lease: params and optimizer on the device):
    b is released and marked failed, a (3 steps) goes on to the end; ``--resume`` then runs only
    b, from its own last checkpoint (step 0), to the end."""
    pytest.importorskip("transformers", reason="a run renders its prompts with the model's tokenizer")
    run_dir = tmp_path / "faulty"
    r = multi_run(run_dir, tiny_ckpt, env={"MLLM_RL_FAULTS": "checkpoint_fails:b:1"})
    assert r.returncode == 1, r.stderr[-3000:]
    assert "task(s) failed: b" in r.stderr
    plan = json.loads((run_dir / "run.json").read_text())
    assert plan["tasks"]["a"]["status"] == "done" and plan["tasks"]["b"]["status"] == "failed"
    assert "could not be written" in plan["tasks"]["b"]["error"]
    recs = read_jsonl(run_dir / "phases.jsonl")
    (fault,) = [x for x in recs if x["phase"] == "release_on_fault"]
    assert fault["task"] == "b" and fault["step"] == 1 and fault["info"]["expected_freed_bytes"] > MIB
    freed = sum(d["bytes_in_use_start"] - d["bytes_in_use"] for d in fault["memory"]["devices"])
    assert freed >= 0.99 * fault["info"]["expected_freed_bytes"]
    leases = read_jsonl(run_dir / "leases.jsonl")
    failed_at = next(i for i, x in enumerate(leases) if x["outcomes"] != ["ok"])
    assert leases[failed_at]["outcomes"] == [plan["tasks"]["b"]["error"]]
    after = leases[failed_at:]
    assert all(x["device_bytes"] < MIB for x in after) and not any(x["task"] == "b" for x in after[1:])
    assert [(x["task"], x["kind"], x["step"]) for x in after[1:]] == [
        ("a", "rollout", 2), ("a", "train", 2), ("a", "final", None)
    ]  # fmt: skip
    errors = json.loads((run_dir / "report" / "summary.json").read_text())["issues"]
    assert {(i["run"].split(" / ")[-1], i["kind"]) for i in errors if i["severity"] == "error"} >= {
        ("b", "task_failed")
    }
    assert not [i for i in errors if i["severity"] == "error" and i["run"].endswith(" / a")]

    r = multi_run(run_dir, tiny_ckpt, "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    plan = json.loads((run_dir / "run.json").read_text())
    assert {n: t["status"] for n, t in plan["tasks"].items()} == {"a": "done", "b": "done"}
    assert plan["tasks"]["b"]["resumed_at"] == 1 and plan["tasks"]["a"]["resumed_at"] == 3
    leases = read_jsonl(run_dir / "leases.jsonl")[len(leases) :]
    assert [(x["task"], x["kind"], x["step"]) for x in leases] == [
        ("b", "setup", None), ("b", "rollout", 1), ("b", "train", 1), ("b", "final", None)
    ]  # fmt: skip
    restored = [x for x in read_jsonl(run_dir / "phases.jsonl") if x["phase"] == "trainer_init"][-1]
    assert restored["task"] == "b" and restored["info"]["restored_from"].endswith("step_000000")
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    # the failure, resumed: notes only
    assert summary["counts"]["error"] == 0 and summary["counts"]["warning"] == 0, summary["issues"]


@pytest.mark.slow  # whole runs (on the fake backend)
def test_a_tasks_file_task_takes_a_dataset_and_a_reward_file(tmp_path):
    """``tests.byo_task.tasks_file_takes_a_dataset_and_a_reward_file`` on the fake backend: the
    data, prompt column and reward file named relative to the TOML file, every sample's reward in
    the task's own rewards.jsonl, the step means the metrics'."""
    pytest.importorskip("transformers", reason="a run renders its prompts with the model's tokenizer")
    tasks_file_takes_a_dataset_and_a_reward_file("fake", tmp_path, module="tests.fake_run")

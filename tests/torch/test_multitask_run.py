"""``python -m mllm_rl.run --backend torch --tasks FILE`` on CPU: two tasks (embedded engines, torch
trainers, different seeds and learning rates, one with LoRA and the garbage guard) in one process;
each task's per-step rewards equal the same task run alone. Runs are subprocesses of the torch
venv's interpreter."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mllm_rl.phases import validate_record
from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli

pytestmark = pytest.mark.slow
SMALL = {"steps": 2, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 8, "checkpoint_every": 0}
TASKS = {"a": {"seed": 0, "lr": 3e-3}, "b": {"seed": 2, "lr": 1e-3, "lora_rank": 4, "check_weights": "true"}}
ENV = {"OMP_NUM_THREADS": "1"}


def test_two_torch_tasks_each_equal_to_its_run_alone(tiny_ckpt, tmp_path):
    lines = ["[defaults]", *(f"{k} = {v}" for k, v in SMALL.items())]
    for name, kw in TASKS.items():
        lines += [
            "",
            "[[task]]",
            f'name = "{name}"',
            f'model = "{tiny_ckpt}"',
            *(f"{k} = {v}" for k, v in kw.items()),
        ]
    (tmp_path / "tasks.toml").write_text("\n".join(lines) + "\n")
    common = ["mllm_rl.run", "--backend", "torch", "--platform", "cpu", "--wandb", "disabled", "--quiet"]
    r = run_cli(*common, "--tasks", str(tmp_path / "tasks.toml"), "--run-dir", str(tmp_path / "multi"), env=ENV,
                timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "multi"
    plan = json.loads((run_dir / "run.json").read_text())
    assert {n: t["status"] for n, t in plan["tasks"].items()} == {"a": "done", "b": "done"}
    recs = read_jsonl(run_dir / "phases.jsonl")
    for x in recs:
        validate_record(x)
        assert "error" not in x["info"]
    assert "check_weights" in plan["tasks"]["b"]["expected_step_phases"]
    assert all(x["info"]["agree_until"] > 0 for x in recs if x["phase"] == "check_weights")
    for x in recs:
        if x["phase"] == "release_rollout" and x["step"] is not None:
            assert set(x["info"]["held"]) == {f"{x['task']}/weights", f"{x['task']}/kv_cache"}
    leases = read_jsonl(run_dir / "leases.jsonl")
    assert all(x["device_bytes"] == 0 for x in leases)  # live_tensors: nothing of any task between leases
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert summary["counts"]["error"] == 0, summary["issues"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    for name, kw in TASKS.items():
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
        extra = ["--lora-rank", str(kw["lora_rank"]), "--check-weights"] if "lora_rank" in kw else []
        alone = tmp_path / f"alone_{name}"
        s = run_cli(*common, "--model", str(tiny_ckpt), "--seed", str(kw["seed"]), "--lr", str(kw["lr"]), *flags,
                    *extra, "--run-dir", str(alone), env=ENV, timeout=900)  # fmt: skip
        assert s.returncode == 0, s.stderr[-3000:]
        want = read_jsonl(alone / "metrics.jsonl")
        got = sorted((x for x in rows if x["task"] == name), key=lambda x: x["step"])
        assert [x["reward_mean"] for x in got] == [x["reward_mean"] for x in want], name
        assert any(x["reward_mean"] > 0 for x in got), name  # equal zeros would prove nothing
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose([x[key] for x in got], [x[key] for x in want], rtol=1e-5, atol=1e-7)

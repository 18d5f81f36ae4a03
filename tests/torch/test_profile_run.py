"""``--profile`` on torch: a run's traced step is a ``torch.profiler`` Chrome trace (the JSON that
Perfetto and chrome://tracing read) with every phase of that step as a ``record_function`` range."""

from __future__ import annotations

import json

import pytest

from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli

pytestmark = pytest.mark.slow  # starts an engine


def test_profile_writes_a_chrome_trace_of_the_named_step(tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli("mllm_rl.run", "--backend", "torch", "--steps", "2", "--profile", "1", "--prompts-per-step", "2",
                "--group-size", "2", "--max-new-tokens", "4", "--checkpoint-every", "0", "--run-dir", str(run_dir),
                "--wandb", "disabled", "--console", "off", timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    index = json.loads((run_dir / "profile" / "index.json").read_text())
    assert index["steps"] == {"1": ["step_1/trace.json"]} and "perfetto" in index["open"]
    trace = json.loads((run_dir / "profile" / "step_1" / "trace.json").read_text())
    events = trace["traceEvents"]
    ranges = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    step_phases = [x["phase"] for x in read_jsonl(run_dir / "phases.jsonl") if x["step"] == 1]
    assert "rollout" in step_phases and "train_step" in step_phases
    assert set(step_phases) <= ranges, set(step_phases) - ranges  # every phase of the traced step
    assert "engine_ready_dummy" not in ranges  # set-up was not traced
    assert any(e["name"].startswith("aten::") for e in events)  # the operators themselves
    assert [x["phase"] for x in read_jsonl(run_dir / "phases.jsonl") if x["step"] == 0] == step_phases

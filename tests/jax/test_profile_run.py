"""``--profile`` on JAX: a run's traced step is a ``jax.profiler`` trace that the profiler's own
reader (``jax.profiler.ProfileData``) loads, with every phase of that step as a named range."""

from __future__ import annotations

import json

import pytest

from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli

pytestmark = pytest.mark.slow  # starts an engine


def test_profile_writes_a_trace_of_the_named_step_that_jax_reads(tmp_path):
    from jax.profiler import ProfileData

    run_dir = tmp_path / "run"
    r = run_cli("mllm_rl.run", "--backend", "jax", "--steps", "2", "--profile", "1", "--prompts-per-step", "2",
                "--group-size", "2", "--max-new-tokens", "4", "--checkpoint-every", "0", "--run-dir", str(run_dir),
                "--wandb", "disabled", "--console", "off", timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    index = json.loads((run_dir / "profile" / "index.json").read_text())
    assert list(index["steps"]) == ["1"] and "xprof --logdir" in index["open"]
    assert f"profile: step(s) 1 traced in {run_dir / 'profile'}" in r.stderr
    xplanes = [f for f in index["steps"]["1"] if f.endswith(".xplane.pb")]
    assert len(xplanes) == 1
    data = ProfileData.from_file(str(run_dir / "profile" / xplanes[0]))
    names = {e.name for plane in data.planes for line in plane.lines for e in line.events}
    step_phases = [x["phase"] for x in read_jsonl(run_dir / "phases.jsonl") if x["step"] == 1]
    assert "rollout" in step_phases and "train_step" in step_phases
    assert set(step_phases) <= names, set(step_phases) - names  # every phase of the traced step
    assert "engine_ready_dummy" not in names  # set-up was not traced
    assert any(n.startswith("PjitFunction(") for n in names)  # the compiled work itself
    recs = read_jsonl(run_dir / "phases.jsonl")
    assert [x["phase"] for x in recs if x["step"] == 0] == step_phases  # tracing changes no phase

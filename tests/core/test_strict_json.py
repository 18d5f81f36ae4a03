"""Non-finite numbers never reach a file as bare ``NaN`` (not JSON): sinks and the report write them as
``"NaN"``/``"Infinity"``; the report names them (``non_finite``), and the lifecycle stops a step whose
loss or grad norm is not finite (``NonFiniteTraining``, exit 5; end to end below on the fake backend
and in tests/torch/test_rl_run.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mllm_rl.lifecycle import NonFiniteTraining, check_finite
from mllm_rl.phases.jsonsafe import dumps, json_safe
from mllm_rl.report import build_report
from mllm_rl.sinks.jsonl import JsonlSink, MetricsJsonlSink, read_jsonl
from tests.core.report_fixtures import read_lines, write_lines, write_rl_run


def strict(text: str):
    def refuse(name: str):
        raise ValueError(f"bare {name}")

    return json.loads(text, parse_constant=refuse)


def test_json_safe_names_every_non_finite_float():
    obj = {"a": float("nan"), "b": [np.float32("inf"), -np.inf, 1.5], "c": (np.int64(3), np.float64(2.0)),
           "d": {"e": np.float32("nan")}, "f": None, "g": True, "h": "NaN"}  # fmt: skip
    assert json_safe(obj) == {"a": "NaN", "b": ["Infinity", "-Infinity", 1.5], "c": [3, 2.0], "d": {"e": "NaN"},
                              "f": None, "g": True, "h": "NaN"}  # fmt: skip
    strict(dumps(obj))
    with pytest.raises(ValueError):
        json.dumps({"x": float("nan")}, allow_nan=False)  # what dumps guards against


def test_sinks_write_strict_json(tmp_path):
    sink = JsonlSink(tmp_path / "phases.jsonl")
    sink.write({"info": {"loss": float("nan"), "grad_norm": np.float32("inf")}})
    sink.close()
    metrics = MetricsJsonlSink(tmp_path / "metrics.jsonl")
    metrics.log_metrics(0, {"loss": float("nan"), "reward_mean": 0.5})
    metrics.close()
    assert strict((tmp_path / "phases.jsonl").read_text())["info"] == {"loss": "NaN", "grad_norm": "Infinity"}
    (line,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert line["loss"] == "NaN" and line["reward_mean"] == 0.5


@pytest.mark.parametrize("written", [float("nan"), "NaN"])  # an old run's bare NaN, or the strict name
def test_report_names_a_non_finite_loss_and_writes_strict_json(tmp_path, written):
    run = write_rl_run(tmp_path / "run", processes=1, steps=2, kind="jax_cpu")
    path = run / "phases.jsonl"
    recs = read_lines(path)
    (train,) = [r for r in recs if r["phase"] == "train_step" and r["step"] == 1]
    train["info"].update(loss=written, grad_norm=1.0)
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")  # json.dumps: bare NaN for the float
    result = build_report([run])
    strict(result.files["trace"].read_text())
    strict(result.files["summary"].read_text())
    (issue,) = [i for i in result.issues if i.kind == "non_finite"]
    assert (
        issue.severity == "error" and issue.step == 1 and issue.message == "train_step: non-finite loss NaN"
    )


def test_a_run_stopped_by_the_watchdog_or_the_nan_check_gets_its_own_finding(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=1, kind="jax_cpu")
    path = run / "phases.jsonl"
    recs = read_lines(path)
    recs[4]["info"].update(error="PhaseStuck: ...", stuck={"limit_s": 60.0, "stacks": "/x/stuck.txt"})
    write_lines(path, recs)
    result = build_report([run])
    assert [i.kind for i in result.errors if i.phase == recs[4]["phase"]] == ["stuck_phase"]
    (stuck,) = [i for i in result.issues if i.kind == "stuck_phase"]
    assert "60.0 s limit" in stuck.message and "/x/stuck.txt" in stuck.message


def test_check_finite_stops_on_loss_or_grad_norm_only():
    info: dict = {}
    check_finite(0, {"loss": 0.1, "grad_norm": 2.0, "kl": float("nan")}, info)  # kl is reported, not fatal
    assert info == {}
    with pytest.raises(NonFiniteTraining, match="train_step of step 3: non-finite loss nan, grad_norm inf"):
        check_finite(3, {"loss": float("nan"), "grad_norm": float("inf")}, info)
    assert info["non_finite"] == ["loss", "grad_norm"]


@pytest.mark.slow  # a whole run (on the fake backend, tests/fake_run.py)
def test_a_nan_reward_stops_a_whole_run_with_exit_5_before_its_checkpoint(tmp_path):
    """Fault ``reward_nan``: the group's advantages, then the loss and the grad norm are NaN; the run
    stops in train_step of step 0 with exit 5 and one error line, saves nothing, and every file it
    wrote (records, metrics, rewards, report, trace) is strict JSON; the W&B sink (offline) takes the
    NaN without failing. With a real engine and trainer: tests/torch/test_rl_run.py."""
    pytest.importorskip("transformers", reason="a run renders its prompts with the model's tokenizer")
    from tests.conftest import run_cli

    run = tmp_path / "run"
    r = run_cli("tests.fake_run", "--backend", "fake", "--run-dir", str(run), "--quiet", "--wandb", "offline",
                "--checkpoint-every", "1", "--platform", "cpu", env={"MLLM_RL_FAULTS": "reward_nan"})  # fmt: skip
    assert r.returncode == 5, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: train_step of step 0: non-finite loss nan")
    last = read_jsonl(run / "phases.jsonl")[-1]
    assert last["phase"] == "train_step" and last["step"] == 0
    assert last["info"]["loss"] == "NaN" and last["info"]["non_finite"] == ["loss", "grad_norm"]
    assert not (run / "checkpoints").exists()  # --checkpoint-every 1, but the step stopped before it
    for path in (run / "phases.jsonl", run / "metrics.jsonl", run / "rewards.jsonl"):
        for line in path.read_text().splitlines():
            strict(line)
    summary = strict((run / "report" / "summary.json").read_text())
    strict((run / "report" / "trace.json").read_text())
    kinds = {i["kind"] for i in summary["issues"] if i["severity"] == "error"}
    assert "non_finite" in kinds and "phase_error" not in kinds

"""Records of multi-task runs: schema v2 (``task``), per-task metrics into a real offline W&B run,
and the report read per task (completeness, failed tasks, one trace lane per task per process).
The run directories come from the real driver and lifecycle over the fakes."""

from __future__ import annotations

import json

import pytest

from mllm_rl.lifecycle import LifecycleOptions
from mllm_rl.multitask.driver import Driver, TaskSteps, lease_schedule
from mllm_rl.multitask.runtime import task_phases
from mllm_rl.phases import PhaseRecorder, SchemaError, validate_record
from mllm_rl.report import build_report
from mllm_rl.run import write_run_json
from mllm_rl.sinks.jsonl import JsonlSink, MetricsJsonlSink, read_jsonl
from tests.core.multitask_fakes import FakeDevice, FakeProbe, FakeTask

STEPS = {"a": 2, "b": 3}


def fake_run(run_dir, fail=None, sinks=()):
    """A two-task run over the fakes, written like ``mllm_rl.run --tasks`` writes one."""
    dev = FakeDevice()
    rec = PhaseRecorder("mt-fake", "fake", sinks=[JsonlSink(run_dir / "phases.jsonl"),
                        MetricsJsonlSink(run_dir / "metrics.jsonl"), *sinks], probe=FakeProbe(dev),
                        sample_interval_s=0, tasks=True)  # fmt: skip
    for name in ("wandb_init", "fake_ready"):
        with rec.phase(name):
            pass
    tasks = {n: FakeTask(n, dev, rec, seed=i, fail_at=(fail or {}).get(n)) for i, n in enumerate(STEPS)}
    opts = LifecycleOptions()
    plan = {"run_id": "mt-fake", "backend": "fake", "plan": "multitask", "process_count": 1,
            "expected_phases": ["wandb_init", "fake_ready"], "expected_step_phases": [], "steps": 0,
            "tasks": {n: {"steps": s, "first_step": 0, "status": "pending", "error": None,
                          **task_phases(opts)}
                      for n, s in STEPS.items()}}  # fmt: skip

    def on_status(statuses):
        for n, st in statuses.items():
            plan["tasks"][n].update(status=st.status, error=st.error)
        write_run_json(run_dir, plan)

    drv = Driver(lease_schedule([TaskSteps(n, 0, s) for n, s in STEPS.items()]), tasks, on_status=on_status)
    drv.run()
    for t in tasks.values():  # what RLTask does after each train lease
        for step, reward in t.rewards.items():
            rec.log_metrics(step, {"reward_mean": reward}, task=t.name)
    rec.close()
    return run_dir


def test_v2_records_name_their_task_and_v1_stays_valid(tmp_path):
    run = fake_run(tmp_path)
    recs = read_jsonl(run / "phases.jsonl")
    assert {r["task"] for r in recs} == {None, "a", "b"}
    for r in recs:
        validate_record(r)
    bad = dict(recs[0])
    del bad["task"]
    with pytest.raises(SchemaError, match="task"):
        validate_record(bad)
    with pytest.raises(SchemaError, match="task"):
        validate_record({**recs[0], "task": 3})
    v1 = PhaseRecorder("r", "fake", sample_interval_s=0)
    with v1.phase("x"):
        pass
    assert v1.records[0]["schema"] == "mllm_rl.phase/1" and "task" not in v1.records[0]
    validate_record(v1.records[0])
    with pytest.raises(RuntimeError, match="tasks=True"), v1.for_task("a"):
        pass


def test_metrics_jsonl_has_one_line_per_task_per_step(tmp_path):
    rows = read_jsonl(fake_run(tmp_path) / "metrics.jsonl")
    assert sorted((r["task"], r["step"]) for r in rows) == [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2)]


def test_report_checks_each_task_and_draws_one_lane_per_task(tmp_path):
    run = fake_run(tmp_path)
    result = build_report([run])
    assert result.errors == [], [i.line() for i in result.errors]
    labels = [an.run.label for an in result.analyses]
    assert labels == ["mt-fake", "mt-fake / a", "mt-fake / b"]
    by = {an.run.label: an for an in result.analyses}
    assert by["mt-fake / b"].expected.steps == [0, 1, 2] and by["mt-fake / a"].expected.steps == [0, 1]
    trace = json.loads(result.files["trace"].read_text())["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    assert sorted(lanes.values()) == ["mt-fake / a rank 0", "mt-fake / b rank 0", "mt-fake rank 0"]
    recs = read_jsonl(run / "phases.jsonl")
    for task in ("a", "b"):
        (pid,) = [p for p, n in lanes.items() if n == f"mt-fake / {task} rank 0"]
        moves = ("offload", "onload", "release", "resume")
        want = sorted(
            (r["phase"], str(r["step"])) for r in recs if r["task"] == task and r["phase"].startswith(moves)
        )
        got = sorted((e["name"], str(e["args"]["step"])) for e in trace
                     if e.get("ph") == "X" and e["pid"] == pid and e["name"].startswith(moves))  # fmt: skip
        assert got == want and len(got) > 10
    # the lanes share the run's time origin: the first record of b starts after a's setup
    xs = {n: min(e["ts"] for e in trace if e.get("ph") == "X" and e["pid"] == p) for p, n in lanes.items()}
    assert xs["mt-fake rank 0"] == 0 < xs["mt-fake / a rank 0"] < xs["mt-fake / b rank 0"]


def test_report_marks_a_failed_task_and_checks_the_others_as_usual(tmp_path):
    run = fake_run(tmp_path, fail={"b": ("train", 1)})
    result = build_report([run])
    kinds = {(i.run, i.kind) for i in result.errors}
    assert ("mt-fake / b", "task_failed") in kinds
    assert all(i.run == "mt-fake / b" for i in result.errors)
    assert not [i for i in result.issues if "release_on_fault" in i.message]  # part of the failure
    assert json.loads((run / "run.json").read_text())["tasks"]["b"]["status"] == "failed"


def test_report_finds_a_missing_offload_in_one_task(tmp_path):
    run = fake_run(tmp_path)
    lines = (run / "phases.jsonl").read_text().splitlines()
    drop = next(i for i, x in enumerate(lines)
                if json.loads(x)["task"] == "b" and json.loads(x)["phase"] == "offload_optimizer"
                and json.loads(x)["step"] == 1)  # fmt: skip
    (run / "phases.jsonl").write_text("\n".join(lines[:drop] + lines[drop + 1 :]) + "\n")
    errors = build_report([run]).errors
    assert [(i.run, i.kind, i.step, i.phase) for i in errors] == [
        ("mt-fake / b", "missing_phase", 1, "offload_optimizer")
    ]


def test_wandb_one_point_per_step_per_task_on_its_own_axis(tmp_path):
    pytest.importorskip("wandb")
    from mllm_rl.sinks.wandb_file import read_history
    from mllm_rl.sinks.wandb_sink import WandbSink

    sink = WandbSink("offline", tmp_path, "mt-wandb")
    fake_run(tmp_path, sinks=[sink])
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-mt-wandb.wandb")
    rows = read_history(run_file)
    for task, steps in STEPS.items():
        mine = [r for r in rows if f"{task}/train/reward_mean" in r]
        assert [r[f"{task}/rl/step"] for r in mine] == list(range(steps))
        assert not any(k.startswith("train/") for r in mine for k in r)
    assert not any("a/train/reward_mean" in r and "b/train/reward_mean" in r for r in rows)

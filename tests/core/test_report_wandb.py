"""``log_report`` into a real offline W&B run, read back from the run file."""

from __future__ import annotations

import json

import pytest

from mllm_rl.phases import PhaseRecorder
from mllm_rl.report import build_report
from tests.core.report_fixtures import STEP, Ctx, FakeDevices, rl_step, run_json, setup


def _summary_items(run_file) -> dict:
    from wandb.proto import wandb_internal_pb2 as pb

    from mllm_rl.sinks.wandb_file import read_wandb_payloads

    out = {}
    for payload in read_wandb_payloads(run_file):
        rec = pb.Record()
        rec.ParseFromString(payload)
        if rec.WhichOneof("record_type") == "summary":
            for item in rec.summary.update:
                out[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return out


def _media(row: dict, key: str) -> dict:
    """A media value of a history row (its fields are stored under nested keys ``key/<field>``)."""
    return {k[len(key) + 1 :]: v for k, v in row.items() if k.startswith(key + "/")}


def test_log_report_tables_and_charts_in_offline_run(tmp_path):
    pytest.importorskip("wandb")
    from mllm_rl.report.wandb_extras import log_report
    from mllm_rl.sinks.jsonl import JsonlSink
    from mllm_rl.sinks.wandb_file import read_history
    from mllm_rl.sinks.wandb_sink import WandbSink

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run_json(run_dir, processes=1, steps=2, run_id="wb-report")
    sink = WandbSink("offline", run_dir, "wb-report")
    rec = PhaseRecorder(
        "wb-report", "fake", sinks=[JsonlSink(run_dir / "phases.jsonl"), sink], sample_interval_s=0
    )
    c = Ctx(rec, FakeDevices(1, "tpu"), 0, set(), {})
    setup(c)
    for s in range(2):
        rl_step(c, s, release_frees=0.0 if s == 1 else 1.0)
    with c.phase("generate_result"):
        pass
    result = build_report([run_dir])  # what mllm_rl.run does at the end, before the W&B run finishes
    keys = log_report(sink.run, result, strict=True)
    rec.close(0)
    assert keys == [
        "report/phases",
        "report/efficiency",
        "report/issues",
        "report/memory_per_phase",
        "report/memory_over_time",
        "report/step_metrics",
    ]

    (run_file,) = run_dir.glob("wandb/offline-run-*/run-wb-report.wandb")
    files = run_file.parent / "files"
    rows = read_history(run_file)
    assert (
        len([r for r in rows if "phase/name" in r]) == 3 + 2 * len(STEP) + 1
    )  # the per-phase rows are untouched
    (row,) = [r for r in rows if "report/phases/_type" in r]
    extra = {k: _media(row, k) for k in keys}
    assert extra["report/phases"]["_type"] == "table-file"
    table = json.loads((files / extra["report/phases"]["path"]).read_text())
    col = table["columns"].index
    assert len(table["data"]) == 3 + 2 * len(STEP) + 1
    assert [row[col("phase")] for row in table["data"][:4]] == [
        "wandb_init",
        "jax_ready",
        "engine_ready",
        "rollout",
    ]
    assert table["data"][0][col("after_bytes")] is None  # unknown stays empty, not 0
    eff = json.loads((files / extra["report/efficiency"]["path"]).read_text())
    flagged = [row for row in eff["data"] if row[eff["columns"].index("flagged")]]
    assert [(row[eff["columns"].index("phase")], row[eff["columns"].index("step")]) for row in flagged] == [
        ("release_rollout", 1)
    ]
    issues = json.loads((files / extra["report/issues"]["path"]).read_text())
    assert [row[issues["columns"].index("kind")] for row in issues["data"]] == ["release_efficiency"]
    for key in ("report/memory_per_phase", "report/memory_over_time", "report/step_metrics"):
        assert extra[key]["_type"] == "html-file"
        page = (files / extra[key]["path"]).read_text()
        assert "<svg" in page and "<script" not in page
    assert "train_step.loss" in (files / extra["report/step_metrics"]["path"]).read_text()
    summary = _summary_items(run_file)
    assert summary["report/errors"] == 0 and summary["report/warnings"] == 1


def test_log_report_not_strict_never_raises(tmp_path, capsys):
    from mllm_rl.report.wandb_extras import log_report
    from tests.core.report_fixtures import write_swap_run

    result = build_report([write_swap_run(tmp_path / "run")])

    class Broken:
        summary: dict = {}

        def log(self, payload):
            raise BrokenPipeError("service gone")

    assert log_report(Broken(), result) == []
    assert "report not logged to W&B: BrokenPipeError" in capsys.readouterr().err
    with pytest.raises(BrokenPipeError):
        log_report(Broken(), result, strict=True)

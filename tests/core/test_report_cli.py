"""``python -m mllm_rl.report``: outputs, exit status, bad input, comparison of several runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mllm_rl.report import build_report
from tests.conftest import ROOT
from tests.core.report_fixtures import MiB, read_lines, write_lines, write_rl_run, write_swap_run


def report_cli(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mllm_rl.report", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )


def test_cli_clean_run_exit_0_and_default_out_dir(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=2, steps=2)
    r = report_cli(run)
    assert r.returncode == 0, r.stderr
    for name in ("trace.json", "report.html", "summary.json"):
        assert (run / "report" / name).is_file()
    summary = json.loads((run / "report" / "summary.json").read_text())
    assert summary["schema"] == "mllm_rl.report/1" and summary["counts"]["error"] == 0
    assert summary["runs"][0]["processes"] == [0, 1] and len(summary["efficiency"]) == 2 * 2 * 6


def test_cli_dropped_phase_exit_1_names_it(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=2, steps=2, drop={(1, 1, "offload_optimizer")})
    r = report_cli(run, "--out", tmp_path / "out")
    assert r.returncode == 1
    assert "error: rl-test process 1 step 1: missing phase offload_optimizer" in r.stderr.splitlines()
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    (err,) = [i for i in summary["issues"] if i["severity"] == "error"]
    assert (err["process"], err["step"], err["phase"]) == (1, 1, "offload_optimizer")


def test_repeated_findings_fold_into_one_line(tmp_path):
    # 2 processes x 2 steps whose release frees nothing: 4 warnings, one line on stderr and in the page
    run = write_rl_run(tmp_path / "run", processes=2, steps=2, release_frees=0.0)
    r = report_cli(run, "--out", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    folded = "rl-test 4x: processes 0-1 steps 0-1: release_rollout freed nothing"
    assert [x for x in r.stderr.splitlines() if not x.startswith("report: ")] == [f"warning: {folded}"]
    assert "0 error(s), 4 warning(s), 0 note(s)" in r.stderr
    html = (tmp_path / "out" / "report.html").read_text()
    assert html.count("release_rollout freed nothing") == html.count(folded) == 1
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [i["line"] for i in summary["issues"]] == [
        f"warning: rl-test process {p} step {s}: release_rollout freed nothing"
        for p in (0, 1)
        for s in (0, 1)
    ]


@pytest.mark.parametrize(
    "case",
    [
        "missing_dir",
        "no_phase_file",
        "not_json",
        "invalid_record",
        "wrong_process",
        "bad_run_json",
        "bad_plan_field",
    ],
)
def test_bad_input_exit_2_one_line_naming_the_file(tmp_path, case):
    run = write_rl_run(tmp_path / "run", processes=2, steps=1)
    path, where = run / "phases.jsonl", None
    recs = read_lines(path)
    if case == "missing_dir":
        run, where = tmp_path / "nope", str(tmp_path / "nope")
    elif case == "no_phase_file":
        for f in run.glob("phases*.jsonl"):
            f.unlink()
        where = str(run)
    elif case == "not_json":
        path.write_text(json.dumps(recs[0]) + "\n{oops\n" + json.dumps(recs[1]) + "\n")
        where = f"{path}:2"
    elif case == "invalid_record":
        recs[3]["memory"]["devices"][0]["source"] = "guess"
        write_lines(path, recs)
        where = f"{path}:4"
    elif case == "wrong_process":
        recs[2]["process_index"] = 1
        write_lines(path, recs)
        where = f"{path}:3"
    elif case == "bad_run_json":
        (run / "run.json").write_text('{"steps": "two"')
        where = str(run / "run.json")
    elif case == "bad_plan_field":
        (run / "run.json").write_text('{"steps": "two"}')
        where = f"{run / 'run.json'}: steps must be"
    r = report_cli(run)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {where}"), r.stderr


def test_compare_two_runs_side_by_side(tmp_path):
    a = write_swap_run(tmp_path / "streaming", swap_extra=2 * MiB, run_id="swap-streaming")
    b = write_swap_run(tmp_path / "naive", swap_extra=40 * MiB, run_id="swap-naive")
    r = report_cli(a, b, cwd=tmp_path)  # default out: ./report-compare
    assert r.returncode == 0, r.stderr
    out = tmp_path / "report-compare"
    summary = json.loads((out / "summary.json").read_text())
    assert [x["label"] for x in summary["runs"]] == ["swap-streaming", "swap-naive"]
    ratios = {x["run"]: x["ratio"] for x in summary["swap_ratios"]}
    assert ratios["swap-naive"] > ratios["swap-streaming"] > 1.0
    rows = {x["phase"]: x for x in summary["comparison"]}
    assert list(rows) == [
        "wandb_init",
        "jax_ready",
        "engine_ready_dummy",
        "weights_swapped",
        "generate_result",
    ]
    sw = rows["weights_swapped"]["runs"]
    assert sw[1]["peak_bytes"] - sw[0]["peak_bytes"] == 38 * MiB
    assert sw[0]["after_bytes"] == sw[1]["after_bytes"]
    html = (out / "report.html").read_text()
    assert ">Comparison<" in html and "swap-streaming" in html and "swap-naive" in html
    trace = json.loads((out / "trace.json").read_text())
    names = sorted(e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name")
    assert names == ["swap-naive rank 0", "swap-streaming rank 0"]


def test_compare_rl_runs_aligns_steps_and_repeated_phases(tmp_path):
    a = write_rl_run(tmp_path / "a", processes=1, steps=2, run_id="same")
    b = write_rl_run(tmp_path / "b", processes=2, steps=2, run_id="same", release_frees=0.0)
    result = build_report([a, b], tmp_path / "out")
    assert [an.run.label for an in result.analyses] == ["same [0:a]", "same [1:b]"]
    rows = {r["phase"]: r for r in result.comparison}
    assert "empty_cache#2 @1" in rows and "release_rollout @0" in rows
    rel = rows["release_rollout @0"]["runs"]
    assert rel[0]["after_bytes"] < rel[1]["after_bytes"]  # b's release freed nothing (and has 2 processes)


def test_build_report_never_raises_on_a_run_that_stopped_before_any_record(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "phases.jsonl").write_text("")  # the sink opened the file, the process died
    result = build_report([run])
    assert [i.kind for i in result.issues] == ["no_records"] and result.exit_code == 1
    assert result.files["html"].exists()
    events = json.loads(result.files["trace"].read_text())["traceEvents"]
    assert events and all(e["ph"] == "M" for e in events)  # the rank's track, nothing in it


def test_odd_but_valid_records_never_raise(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=1, kind="cuda")
    path = run / "phases.jsonl"
    recs = read_lines(path)
    recs[4]["info"] = {
        "error": {"code": 7, "text": "<b>oom</b>"},
        "nested": [[1, 2], {"a": None}],
        "s": "x" * 5000,
        "nan_like": "NaN",
        "flag": True,
        "expected_freed_bytes": {"kv": 5, "weights": None},
    }
    recs[5]["memory"]["devices"][0].update(id=None, bytes_in_use=None, phase_peak_bytes=None)
    recs[6]["phase"] = "<script>alert(1)</script>"
    write_lines(path, recs)
    result = build_report([run])
    html = result.files["html"].read_text()
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert any(i.kind == "phase_error" and "oom" in i.message for i in result.issues)
    json.loads(result.files["trace"].read_text())


def test_screenshot_script(tmp_path):
    import shutil

    script = ROOT / "scripts" / "screenshot_report.sh"
    r = subprocess.run(
        [str(script), str(tmp_path / "nope"), str(tmp_path / "x.png")], capture_output=True, text=True
    )
    assert r.returncode == 2 and "no such file" in r.stderr
    if not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")):
        pytest.skip("no chromium: apt-get install -y chromium")
    run = write_swap_run(tmp_path / "run")
    build_report([run])
    out = tmp_path / "shot.png"
    r = subprocess.run(
        [str(script), str(run), str(out), "800", "600"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(data[16:20], "big") == 800

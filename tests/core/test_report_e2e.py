"""End to end: a real ``--plan swap`` jax run (subprocess, JAX CPU), then ``python -m mllm_rl.report``."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.conftest import run_cli
from tests.core.test_report_trace import check_chrome_trace

PHASES = ["wandb_init", "jax_ready", "engine_ready_dummy", "weights_swapped", "generate_result"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="needs the jax backend (.venv-jax)"),
]


def test_report_of_a_real_swap_run(tiny_ckpt, tmp_path):
    run_dir = tmp_path / "run"
    r = run_cli(
        "mllm_rl.run",
        "--backend",
        "jax",
        "--plan",
        "swap",
        "--model",
        str(tiny_ckpt),
        "--run-dir",
        str(run_dir),
        "--max-new-tokens",
        "4",
        "--wandb",
        "disabled",
        "--quiet",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_cli("mllm_rl.report", str(run_dir))
    assert r.returncode == 0, r.stderr
    assert "0 error(s)" in r.stderr
    out = run_dir / "report"
    events = check_chrome_trace(json.loads((out / "trace.json").read_text()))
    assert [e["name"] for e in events if e["ph"] == "X"] == PHASES
    assert {e["name"] for e in events if e["ph"] == "C"} >= {"mem cpu:0 (live_arrays)", "host rss"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"][0]["expected"]["source"] == "run.json"
    (swap,) = summary["swap_ratios"]
    assert swap["phase"] == "weights_swapped" and 1.0 <= swap["ratio"] < 1.5
    rows = {row["phase"]: row for row in summary["phases"]}
    assert rows["wandb_init"]["after_bytes"] is None  # no device probe yet: unknown, shown as '-'
    assert (
        rows["engine_ready_dummy"]["after_bytes"] > 0
        and rows["engine_ready_dummy"]["source"] == "live_arrays"
    )
    html = (out / "report.html").read_text()
    assert "weights_swapped" in html and "<svg" in html

"""trace.json is valid Chrome/Perfetto trace JSON with the expected tracks; report.html is self-contained."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from mllm_rl.report import build_report
from mllm_rl.report.load import load_run
from tests.core.report_fixtures import STEP, write_rl_run, write_swap_run

REQUIRED = {
    "X": ("name", "ph", "ts", "dur", "pid", "tid"),
    "C": ("name", "ph", "ts", "pid", "args"),
    "M": ("name", "ph", "pid", "args"),
    "i": ("name", "ph", "ts", "pid", "tid", "s"),
}


def _no_nan(text: str) -> dict:
    def bad(c):
        raise ValueError(f"non-JSON constant {c}")

    return json.loads(text, parse_constant=bad)


def check_chrome_trace(trace: dict) -> list[dict]:
    """Assert the Chrome trace event format rules the report relies on; return the events."""
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    for e in events:
        assert e["ph"] in REQUIRED, e
        for k in REQUIRED[e["ph"]]:
            assert k in e, (k, e)
        assert isinstance(e["pid"], int) and e["pid"] in names, e
        if "ts" in e:
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
        if e["ph"] == "C":
            assert e["args"] and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in e["args"].values()
            ), e
    return events


def test_trace_is_valid_with_rank_tracks_phases_and_counters(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=2, steps=2, kind="cuda", devices=2)
    result = build_report([run])
    events = check_chrome_trace(_no_nan(result.files["trace"].read_text()))
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(procs.values()) == ["rank 0", "rank 1"]
    recs = load_run(run).records
    for pid, name in procs.items():
        p = int(name.split()[1])
        slices = [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["cat"] == "phase"]
        assert [e["name"] for e in slices] == [r["phase"] for r in recs[p]]
        assert [e["args"]["step"] for e in slices] == [r["step"] for r in recs[p]]
        train = next(e for e in slices if e["name"] == "train_step")
        assert train["args"]["info"]["loss"] == 1.0
        assert set(train["args"]["memory"]) == {
            "cuda:0 (mem_get_info)",
            "cuda:0 (torch_allocator)",
            "cuda:1 (mem_get_info)",
            "cuda:1 (torch_allocator)",
            "host rss",
        }
        steps = [e["name"] for e in events if e["ph"] == "X" and e["pid"] == pid and e["cat"] == "step"]
        assert steps == ["step 0", "step 1"]
        counters = {e["name"] for e in events if e["ph"] == "C" and e["pid"] == pid}
        assert {
            "device truth cuda:0 (mem_get_info)",
            "device truth cuda:1 (mem_get_info)",
            "mem cuda:0 (torch_allocator)",
            "mem cuda:1 (torch_allocator)",
            "host rss",
            "phase peak device truth cuda:0 (mem_get_info)",
        } <= counters
    # counters follow the records exactly: end of release_rollout on rank 0, device 0
    rel = next(r for r in recs[0] if r["phase"] == "release_rollout")
    t0 = min(r["t_start"] for rs in recs.values() for r in rs)
    pid0 = next(pid for pid, n in procs.items() if n == "rank 0")
    pts = [
        e
        for e in events
        if e["ph"] == "C"
        and e["pid"] == pid0
        and e["name"] == "device truth cuda:0 (mem_get_info)"
        and abs(e["ts"] - (rel["t_end"] - t0) * 1e6) < 1
    ]
    assert [e["args"]["bytes"] for e in pts] == [rel["memory"]["devices"][0]["bytes_in_use"]]


def test_null_values_make_no_counter_point(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=1, kind="jax_cpu", devices=1)
    result = build_report([run])
    events = check_chrome_trace(json.loads(result.files["trace"].read_text()))
    ready = next(e for e in events if e["ph"] == "X" and e["name"] == "jax_ready")
    assert ready["args"]["memory"]["cpu:0 (live_arrays)"]["before"] is None
    at_start = [
        e
        for e in events
        if e["ph"] == "C" and e["name"] == "mem cpu:0 (live_arrays)" and e["ts"] == ready["ts"]
    ]
    assert at_start == []  # unknown at the start of jax_ready: no point, not a 0


def test_failed_phase_gets_an_instant_event(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=1, steps=2, fail_in=(1, "update_weights"))
    events = check_chrome_trace(json.loads(build_report([run]).files["trace"].read_text()))
    (inst,) = [e for e in events if e["ph"] == "i"]
    assert inst["name"] == "error: update_weights" and "RESOURCE_EXHAUSTED" in inst["args"]["error"]


def test_html_is_self_contained_and_shows_unknown_as_dash(tmp_path):
    run = write_rl_run(tmp_path / "run", processes=2, steps=2, kind="cuda")
    html = build_report([run]).files["html"].read_text()
    assert "<script" not in html and "<link" not in html and " src=" not in html
    assert set(re.findall(r"https?://[^\s\"'<>]+", html)) == {"http://www.w3.org/2000/svg"}
    for section in (
        "Findings",
        "Memory per phase per device",
        "Memory over time",
        "Offload efficiency",
        "RL metrics per step",
        "Phases",
    ):
        assert f">{section}<" in html, section
    assert "train_step.loss" in html and "train_step.reward_mean" in html
    # wandb_init has no device: its row shows '-' for bytes, never 0
    row = re.search(r"<tr[^>]*><td>0</td><td>-</td><td class=l>wandb_init</td>(.*?)</tr>", html)
    assert row and re.findall(r"<td>([^<]*)</td>", row.group(1))[2:6] == ["-", "-", "-", "-"]


def test_a_few_hundred_records_from_four_processes_build(tmp_path):
    """Size only: how fast it builds is measured by ``python -m mllm_rl.bench report``, not here."""
    run = write_rl_run(tmp_path / "run", processes=4, steps=5, kind="cuda", devices=2)
    n = sum(len(v) for v in load_run(run).records.values())
    assert n == 4 * (3 + 5 * len(STEP) + 1)  # 296 records
    result = build_report([run])
    assert result.exit_code == 0
    events = json.loads(result.files["trace"].read_text())["traceEvents"]
    assert len({e["pid"] for e in events if e.get("ph") == "X"}) == 4  # one track per process


def test_report_package_imports_no_framework():
    code = (
        "import sys, json; import mllm_rl.report, mllm_rl.report.__main__, mllm_rl.report.wandb_extras;"
        "print(json.dumps([m for m in ('jax', 'torch', 'flax', 'matplotlib', 'wandb') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_swap_run_trace_has_five_phase_slices(tmp_path):
    run = write_swap_run(tmp_path / "run")
    events = check_chrome_trace(json.loads(build_report([run]).files["trace"].read_text()))
    assert [e["name"] for e in events if e["ph"] == "X"] == [
        "wandb_init",
        "jax_ready",
        "engine_ready_dummy",
        "weights_swapped",
        "generate_result",
    ]

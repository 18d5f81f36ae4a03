"""One benchmark script end to end on the torch CPU engine (tiny): the shared bench ending
(``bench_common.run_bench``) prints the report, writes ``--json`` and ends stdout with one JSON
line, and the release figures it reports are the engine's real ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_release_tiny_writes_json_and_meets_its_targets(tmp_path):
    out = tmp_path / "release.json"
    env = {**os.environ, "MLLM_RL_NO_PROGRESS": "1"}
    cmd = [sys.executable, "scripts/bench_release.py", "--backend", "torch", "--preset", "tiny"]
    r = subprocess.run(
        [*cmd, "--platform", "cpu", "--strict", "--json", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    saved = json.loads(out.read_text())
    assert last["targets"] == saved["targets"]
    assert saved["targets"], "no targets reported"
    assert all(t["pass"] for t in saved["targets"].values()), saved["targets"]
    assert "held MiB" in r.stderr  # the human table
    assert set(saved["tags"]) == {"kv_cache", "weights"}
    weights = saved["tags"]["weights"]
    assert weights["held_bytes"] > 0 and weights["freed_bytes"] == weights["held_bytes"]

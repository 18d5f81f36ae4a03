"""``python -m mllm_rl.bench release`` runs on CPU with tiny (so it is known to work before it runs for qwen3-4b
on a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # every test here starts an engine (or waits on one that did)


def test_bench_release_reports_freed_bytes_per_tag(tmp_path):
    saved = tmp_path / "release.json"
    r = subprocess.run([sys.executable, "-m", "mllm_rl.bench", "release", "--backend", "torch",
                        "--preset", "tiny", "--platform", "cpu", "--strict", "--json", str(saved)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]  # --strict: exit 1 if a target failed
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert json.loads(saved.read_text())["targets"] == out["targets"] and out["targets"]
    assert "held MiB" in r.stderr  # the human table goes to stderr, the JSON line last on stdout
    assert out["source"] == "live_tensors" and out["memory_mode"] == "storage_resize"
    for tag in ("kv_cache", "weights"):
        t = out["tags"][tag]
        assert (
            t["held_bytes"] > 0 and t["freed_frac"] >= 0.99 and t["reclaimed_bytes"] >= 0.99 * t["held_bytes"]
        )
        assert t["release_s"] >= 0 and t["resume_s"] >= 0
    assert out["greedy_identical"] is True and out["resync_s"] > 0  # no backup: a full re-sync ran

"""``python -m mllm_rl.bench checkpoint-write`` (torch, the default framework): the seven ways side
by side, one JSON summary last."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_bench_checkpoint_write_times_every_way_against_the_host_copy(tmp_path):
    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "mllm_rl.bench", "checkpoint-write", "--mb", "8",
                        "--repeats", "1", "--shards", "3", "--dir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last == json.loads(out.read_text())
    ways = {
        "host copy",
        "save + read back",
        "save + CRC32s, hashed while written",
        "save, hashed while written",
        "the trainer's: 3 files at once",
        "the same, synced to disk",
        "the same, pages kept in the page cache",
    }
    assert set(last["median_s"]) == ways and all(v > 0 for v in last["median_s"].values())
    assert last["x_host_copy"]["host copy"] == 1.0 and last["bytes"] == 8 * 2**20 and last["shards"] == 3
    assert last["framework"] == "torch"
    assert "CPU figure" in r.stdout and list(tmp_path.iterdir()) == [out]  # its files are gone

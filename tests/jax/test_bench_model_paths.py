"""``python -m mllm_rl.bench model-paths``: its CLI, and a real ahead-of-time TPU compile of both paths of
the tiny model (needs libtpu, the ``jax[tpu]`` wheel; no TPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, needs_libtpu

BENCH = [sys.executable, "-m", "mllm_rl.bench", "model-paths"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*BENCH, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_help():
    r = run("--help")
    assert r.returncode == 0 and "usage:" in r.stdout and "--paths" in r.stdout and "predicted" in r.stdout


@pytest.mark.parametrize(
    "args, pattern",
    [
        (["--model", "qwen9"], "unknown preset"),
        (["--batch", "0"], "must be > 0"),
        (["--paths", "old,fast"], "choose from old, new"),
        (["--target", "v9-8"], "invalid choice"),
        (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, pattern):
    r = run(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "error" in r.stderr.strip().splitlines()[-1] and pattern in r.stderr


@pytest.mark.slow
def test_both_paths_compile_for_v4_8(tmp_path):
    """The trainer's grad step of the tiny model, old and new (splash attention) path, through
    libtpu's compiler for the 4 devices of a v4-8."""
    needs_libtpu()
    out = tmp_path / "r.json"
    r = run("--model", "tiny", "--batch", "4", "--seq", "256", "--json", str(out), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["libtpu"][0].isdigit() and res["target"] == "v4-8"
    for path in ("old", "new"):
        p = res["paths"][path]
        assert p["fits"] is True and p["devices"] == 4, p
        assert p["peak_bytes"] > 0 and p["argument_bytes"] > 0 and p["compile_s"] > 0
    assert res["paths"]["new"]["options"]["attention"] == "splash"
    assert {"peak_bytes", "compile_s", "host_peak_rss_bytes"} <= set(res["ratios_new_over_old"])
    assert json.loads(r.stdout.strip().splitlines()[-1])["bench"] == "model_paths"

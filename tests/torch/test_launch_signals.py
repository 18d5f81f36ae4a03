"""SIGTERM to ``python -m mllm_rl.launch`` while the processes of a torch run wait on each other:
process 1 inside a collective that process 0 never joins, process 0 in its ``finally``'s barrier
(``tests/launch_term_child.py``, what a run's processes do when SIGTERM lands during a step). Each
process ends itself ``signals.TERM_BOUND_S`` after SIGTERM, so the launcher exits 143 within 10 s
with no process left (not 137 after its grace period)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import ROOT


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_during_a_collective_ends_every_process_and_the_launcher_exits_143(tmp_path):
    cmd = [sys.executable, "-m", "mllm_rl.launch", "--nproc", "2", "--module", "tests.launch_term_child",
           "--grace-s", "30", "--", str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while (
            len(list(tmp_path.glob("*.pid"))) < 2 and launcher.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
        time.sleep(1.0)  # process 1 inside its collective
        launcher.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        _, err = launcher.communicate(timeout=120)
        took = time.monotonic() - t0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 143 and took < 10, (launcher.returncode, took, err[-3000:])
    assert not [p for p in pids if alive(p)]

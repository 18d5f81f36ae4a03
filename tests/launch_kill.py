"""A process of a launched run killed mid-step (``python -m mllm_rl.launch --nproc 2``): the JAX and
the torch tests call ``kill_process_1_in_step_1`` with their run's command, then resume it."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import ROOT


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_process_1_in_step_1(cmd: list[str], env: dict[str, str], run_dir: Path) -> None:
    """Start ``cmd`` (a launcher of 2 processes writing ``run_dir``), SIGKILL process 1 once its
    phases reach step 1, and check: the launcher stops process 0 (SIGTERM, its run closes its logs)
    and exits 137 (128 + SIGKILL, the first failure) within a minute, and no process of the run is
    left."""
    launcher = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 600
        p1_phases = run_dir / "phases.p1.jsonl"
        while time.monotonic() < deadline and launcher.poll() is None:
            if p1_phases.exists() and any(x["step"] == 1 for x in read_jsonl(p1_phases)):
                break
            time.sleep(0.2)
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        tree = _descendants(launcher.pid)
        p1 = next(p for p in _children(launcher.pid)
                  if b"MLLM_RL_PROCESS_ID=1\0" in Path(f"/proc/{p}/environ").read_bytes())  # fmt: skip
        os.kill(p1, signal.SIGKILL)
        t0 = time.monotonic()
        _, err = launcher.communicate(timeout=120)
        assert launcher.returncode == 137, err[-3000:]
        assert time.monotonic() - t0 < 60  # process 0 stopped on SIGTERM, well within the grace period
        assert "launch: process 1 exited 137; stopping the others" in err
        assert not [p for p in tree if _alive(p)]  # no orphan: every process of the run is gone
    finally:
        if launcher.poll() is None:
            launcher.kill()

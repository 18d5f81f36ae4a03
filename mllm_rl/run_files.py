"""A run directory's file names and writers, and its lock: an exclusive ``flock`` on ``.lock``
(``.lock.p<i>`` for process i > 0) held until the process exits, naming its holder (pid, host, run
id, since when), so a second run on the directory is refused with one line (``RunDirBusy``: exit 2)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any


def phase_file_name(process_index: int) -> str:
    """``phases.jsonl`` for process 0, ``phases.p<i>.jsonl`` for the others (one file each)."""
    return "phases.jsonl" if process_index == 0 else f"phases.p{process_index}.jsonl"


def write_run_json(run_dir: Path, plan: dict[str, Any]) -> None:
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(json.dumps(plan, indent=2))
    os.replace(tmp, run_dir / "run.json")


_HELD: list[Any] = []  # open lock files of this process (closing one would release its lock)


class RunDirBusy(ValueError):
    """Another live process holds the run directory."""


def lock_name(process_index: int) -> str:
    return ".lock" if process_index == 0 else f".lock.p{process_index}"


def _busy(run_dir: Path, holder: str) -> RunDirBusy:
    try:
        h = json.loads(holder)
        who = f"pid {h['pid']} on {h['host']}, run {h['run_id']}, since {h['since']}"
    except (ValueError, KeyError, TypeError):
        who = "another process"
    return RunDirBusy(
        f"--run-dir {run_dir} is in use by another run ({who}); wait for it to end or choose another --run-dir"
    )


def check_free(run_dir: Path) -> None:
    """``RunDirBusy`` when a live run holds ``run_dir`` (process 0's lock), found in ``/proc/locks``
    without touching the lock (a peek that took it, even briefly, could refuse the run that holds
    it next): a busy directory is refused before start-up. Elsewhere ``acquire`` decides."""
    path = run_dir / lock_name(0)
    try:
        st = path.stat()
        locks = Path("/proc/locks").read_text()
    except OSError:
        return
    key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    # "1: FLOCK  ADVISORY  WRITE <pid> <maj>:<min>:<inode> 0 EOF" (a waiter's line has "->")
    if any(
        len(f) > 5 and f[1:4] == ["FLOCK", "ADVISORY", "WRITE"] and f[5] == key
        for f in map(str.split, locks.splitlines())
    ):
        holder = ""
        for wait in (0.0, 0.1):  # the holder writes its name right after taking the lock
            time.sleep(wait)
            with contextlib.suppress(OSError):
                holder = path.read_text().strip()
            if holder:
                break
        raise _busy(run_dir, holder)


def acquire(run_dir: Path, process_index: int, run_id: str) -> Path:
    """Take the run directory's lock for this process (``run_dir`` must exist); its path."""
    path = run_dir / lock_name(process_index)
    f = open(path, "a+")  # noqa: SIM115 -- held open for the life of the process
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise _busy(run_dir, holder) from None
    f.seek(0)
    f.truncate()
    holder = {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "run_id": run_id,
        "since": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    f.write(json.dumps(holder))
    f.flush()
    _HELD.append(f)
    return path

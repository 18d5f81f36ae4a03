"""What ran: host CPU/memory, GPUs (nvidia-smi), Python, package versions, git commit, load, date;
and the command line of the running script (both go into every benchmark's JSON)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# The source checkout this package runs from (an editable install, as the Makefile and
# scripts/gpu_bench_all.sh set up); a wheel install has none, and ``git`` is then None.
ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "jax",
    "jaxlib",
    "flax",
    "sglang-jax",
    "torch",
    "transformers",
    "torch-memory-saver",
    "sglang",
    "numpy",
)


def _first_field(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def load_avg_1m() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine_info() -> dict[str, Any]:
    """What ran: host CPU/memory, GPUs (nvidia-smi), Python, package versions, git commit, date."""
    mem = _first_field("/proc/meminfo", "MemTotal")
    versions = {}
    for p in PACKAGES:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            continue
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host_cpu": _first_field("/proc/cpuinfo", "model name"),
        "cpu_count": os.cpu_count(),
        "host_mem_bytes": int(mem.split()[0]) * 1024 if mem else None,
        "load_avg_1m": load_avg_1m(),
        "gpus": _nvidia_smi(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "versions": versions,
        "git": GIT_AT_START,  # the code that ran, not what HEAD became while it ran
    }


def _nvidia_smi() -> list[str] | None:
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in r.stdout.splitlines() if line.strip()] if r.returncode == 0 else None


def _git() -> dict[str, Any] | None:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


GIT_AT_START = _git()  # read when a bench script imports this module, i.e. when it starts


def command_line() -> str:
    """This script's command line, as the user typed it (for the JSON and the docs)."""
    return " ".join([Path(sys.argv[0]).as_posix() if sys.argv else "", *sys.argv[1:]]).strip()

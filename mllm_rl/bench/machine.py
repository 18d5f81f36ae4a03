"""What ran: host CPU/memory, GPUs (nvidia-smi), Python, package versions, git commit, load, date;
and the command line of the running benchmark (both go into every benchmark's JSON)."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

# The source checkout this package runs from (an editable install, as the Makefile and
# scripts/gpu_bench_all.sh set up); a wheel install has none, and ``git`` is then None.
ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("jax", "jaxlib", "flax", "sglang-jax", "torch", "transformers", "torch-memory-saver", "sglang",
            "numpy")  # fmt: skip


def _first_field(path: str, key: str) -> str | None:
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith(key)), None)


def load_avg_1m() -> float | None:
    """The 1-minute load average (None where the OS has none)."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


REPORTING = Path("/sys/module/page_reporting/parameters/reported_kib")


def reported_kib() -> int | None:
    """KiB of free memory the kernel has reported to its hypervisor since boot (a VM's balloon
    driver hands those pages back; touching them again is slow: ``bench first-touch``); None
    where nothing reports."""
    try:
        return int(REPORTING.read_text())
    except (OSError, ValueError):
        return None


def machine_info() -> dict[str, Any]:
    """What ran: host CPU/memory (and whether free memory goes back to a hypervisor), GPUs
    (nvidia-smi), Python, package versions, git commit, date."""
    mem = _first_field("/proc/meminfo", "MemTotal")
    versions = {}
    for p in PACKAGES:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            continue
    return {"date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "host_cpu": _first_field("/proc/cpuinfo", "model name"), "cpu_count": os.cpu_count(),
            "host_mem_bytes": int(mem.split()[0]) * 1024 if mem else None, "load_avg_1m": load_avg_1m(),
            "free_page_reporting": reported_kib() is not None,
            "gpus": _nvidia_smi(), "python": platform.python_version(), "executable": sys.executable,
            "versions": versions, "git": GIT_AT_START}  # the code that ran, not HEAD after it  # fmt: skip


def _output(cmd: list[str], timeout: float, cwd: Path | None = None) -> str | None:
    """The stdout of ``cmd``; None when it fails or cannot run."""
    try:
        r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout if r.returncode == 0 else None


def _nvidia_smi() -> list[str] | None:
    out = _output(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"], 20)
    return None if out is None else [line.strip() for line in out.splitlines() if line.strip()]


def _git() -> dict[str, Any] | None:
    head = _output(["git", "rev-parse", "--short", "HEAD"], 10, ROOT)
    dirty = _output(["git", "status", "--porcelain", "--untracked-files=no"], 10, ROOT)
    return None if head is None else {"commit": head.strip(), "dirty": bool((dirty or "").strip())}


GIT_AT_START = _git()  # read when a benchmark imports this module, i.e. when it starts


def command_line() -> str:
    """This benchmark's command line as typed (the driver sets ``sys.argv[0]``)."""
    return " ".join([Path(sys.argv[0]).as_posix() if sys.argv else "", *sys.argv[1:]]).strip()


def bench_json(bench: str, args: Any, keys: Sequence[str] = (), **fields: Any) -> dict[str, Any]:
    """A bench's JSON: its name, the flags ``keys`` of ``args``, ``fields``, the command, the machine."""
    flags = {k: getattr(args, k) for k in keys}
    return {"bench": bench, **flags, **fields, "command": command_line(), "machine": machine_info()}

"""Running a child process of a benchmark (an RL run, a worker, a copy baseline): each in a fresh
process, so device memory starts empty; failures become ``BenchError`` with the stderr tail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mllm_rl.bench import MiB
from mllm_rl.bench.machine import ROOT

OOM_MARKERS = ("out of memory", "resource_exhausted", "outofmemoryerror", "failed to allocate", "oom")
# lines XLA's CUDA client repeats per loaded module once the context has failed; they bury the error
NOISE = ("Failed to unload module", "=== Source Location Trace", "stream_executor/cuda/cuda_status.cc")


class BenchError(RuntimeError):
    """A benchmark could not run; ``str(e)`` starts with one line saying why."""


def flags(**kw: Any) -> list[str]:
    """``--name value`` per keyword, in order (True: the bare flag; None or False: left out)."""
    out: list[str] = []
    for k, v in kw.items():
        if v is not None and v is not False:
            out += [f"--{k.replace('_', '-')}", *([] if v is True else [str(v)])]
    return out


def run_argv(run_dir: str | Path, *extra: str, python: str = sys.executable, **kw: Any) -> list[str]:
    """``python -m mllm_rl.run`` with ``kw`` as flags, quiet, no wandb, into ``run_dir``, then ``extra``."""
    return [python, "-m", "mllm_rl.run", *flags(**kw, wandb="disabled", quiet=True, run_dir=run_dir), *extra]


def run_phases(
    what: str, timeout: float | None, extra: Sequence[str] = (), **kw: Any
) -> tuple[list[dict[str, Any]], str]:
    """``run_argv`` (``kw``, then ``extra``) in a temporary directory: its phase records and its
    error ('' when it succeeded: a failure, e.g. an out-of-memory, is data for some benches)."""
    from mllm_rl.sinks.jsonl import read_jsonl

    with tempfile.TemporaryDirectory() as d:
        try:
            run_cmd(run_argv(d, *extra, **kw), what, timeout=timeout)
            err = ""
        except BenchError as e:
            err = str(e)
        path = Path(d) / "phases.jsonl"
        return (read_jsonl(path) if path.exists() else []), err


def bench_argv(name: str, *args: str, python: str = sys.executable) -> list[str]:
    """``python -m mllm_rl.bench NAME ARGS`` under ``python`` (a bench's own child)."""
    return [python, "-m", "mllm_rl.bench", name, *args]


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment with ``env`` on top, no progress bars, unbuffered, and JAX's persistent
    compilation cache and the memory planners' cache off unless set (a figure must not depend on
    what earlier runs cached)."""
    return {"JAX_COMPILATION_CACHE_DIR": "", "MLLM_RL_PLAN_CACHE": "", **os.environ, "MLLM_RL_NO_PROGRESS": "1",
            "PYTHONUNBUFFERED": "1", **(env or {})}  # fmt: skip


def run_cmd(
    cmd: Sequence[str], what: str, timeout: float | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repo root; ``BenchError`` naming ``what`` with the stderr tail on failure."""
    cwd = ROOT if (ROOT / "pyproject.toml").exists() else None
    try:
        r = subprocess.run(
            list(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=child_env(env)
        )
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what}: timed out after {timeout}s: {' '.join(cmd)}") from None
    if r.returncode != 0:
        raise BenchError(f"{what} failed (exit {r.returncode}): {' '.join(cmd)}\n{stderr_tail(r.stderr)}")
    return r


def stderr_tail(text: str, chars: int = 3000) -> str:
    """The last ``chars`` of a child's stderr, without blank lines and ``NOISE``."""
    keep = [line for line in text.splitlines() if line.strip() and not any(n in line for n in NOISE)]
    return "\n".join(keep)[-chars:]


def is_oom(text: str) -> bool:
    """Whether ``text`` (a child's stderr) reports running out of memory."""
    low = text.lower()
    return any(m in low for m in OOM_MARKERS)


def run_json(cmd: Sequence[str], what: str, timeout: float | None = None) -> dict[str, Any]:
    """``run_cmd``, then the last line of its stdout that is a JSON object (what every child prints last)."""
    for line in reversed(run_cmd(cmd, what, timeout=timeout).stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise BenchError(f"{what}: printed no JSON line")


def warm_page_cache(path: Path) -> dict[str, Any]:
    """Read every file under ``path`` once (so a child's later read comes from the page cache)."""
    t0, n = time.perf_counter(), 0
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while chunk := fh.read(64 * MiB):
                    n += len(chunk)
    dt = time.perf_counter() - t0
    return {"bytes": n, "seconds": round(dt, 3), "gbps": round(n / dt / 1e9, 3) if dt > 0 else None}

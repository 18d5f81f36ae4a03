"""Shared pieces of the benchmark scripts (``scripts/bench_*.py``, ``scripts/soak.py``).

Also a small CLI, run by the drivers in a fresh process of the benchmark's own venv:

    python scripts/bench_common.py copy --backend jax|torch --mb 1024 [--platform auto] [--repeats 5]

prints one JSON object: the copy bandwidths of this machine for the backend's runtime
(``copy_bandwidth``). Nothing here imports jax or torch at module level.

Device truth: a phase record has, per local device, one entry per memory source; the first
entry of each device id is the device truth (``memory_stats`` on JAX TPU/GPU, ``live_arrays``
on JAX CPU, ``mem_get_info`` on CUDA torch, ``live_tensors`` on torch CPU). ``truth`` picks
those; ``allocator`` picks the torch allocator's entries (CUDA) when present.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GiB = 2**30
MiB = 2**20
OOM_MARKERS = ("out of memory", "resource_exhausted", "outofmemoryerror", "cuda error: out of memory",
               "failed to allocate", "oom")  # fmt: skip
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


class BenchError(RuntimeError):
    """A benchmark could not run; ``str(e)`` starts with one line saying why."""


# -- environment ---------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """What ran: host CPU/memory, GPUs (nvidia-smi), Python, package versions, git commit, date."""
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    versions = {}
    for p in PACKAGES:
        try:
            versions[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            continue
    return {
        "date_utc": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host_cpu": cpu,
        "cpu_count": os.cpu_count(),
        "host_mem_bytes": mem,
        "load_avg_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "gpus": _nvidia_smi(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "versions": versions,
        "git": GIT_AT_START,  # the code that ran, not what HEAD became while it ran
    }


def _nvidia_smi() -> list[str] | None:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in r.stdout.splitlines() if line.strip()] if r.returncode == 0 else None


def _git() -> dict[str, Any] | None:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10)  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


GIT_AT_START = _git()  # read when a bench script imports this module, i.e. when it starts


def command_line() -> str:
    """This script's command line, as the user typed it (for the JSON and the docs)."""
    return " ".join([Path(sys.argv[0]).as_posix() if sys.argv else "", *sys.argv[1:]]).strip()


def write_json(path: Path | None, obj: dict[str, Any]) -> None:
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def run_bench(
    bench: Callable[[Any], dict[str, Any]],
    args: Any,
    report: Callable[[dict[str, Any]], str],
    summary: Callable[[dict[str, Any]], dict[str, Any]],
    report_to_stderr: bool = False,
) -> tuple[int, dict[str, Any] | None]:
    """The shared end of every bench script: run ``bench(args)``, print the human report, write
    ``--json``, print one JSON summary line last (what ``gpu_bench_all.sh`` and tests parse).

    Returns ``(exit code, results)``: 2 on bad input (``ValueError``, incl. ``CheckpointError``:
    one line on stderr), 1 on a ``BenchError``, else 0 and the results (the caller decides whether
    failed targets turn the 0 into a 1).
    """
    try:
        out = bench(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1, None
    except ValueError as e:  # bad preset / checkpoint / backend / flag value: one line
        print(f"error: {e}", file=sys.stderr)
        return 2, None
    text = report(out)
    if text:
        print(text, file=sys.stderr if report_to_stderr else sys.stdout)
    write_json(getattr(args, "json", None), out)
    print(json.dumps(summary(out), default=str), flush=True)
    return 0, out


def failed_targets(out: dict[str, Any]) -> bool:
    """True when a target that applies failed (``pass`` is False; None = not applicable)."""
    return any(t.get("pass") is False for t in out.get("targets", {}).values())


def positive(kind: type = int) -> Callable[[str], Any]:
    """argparse type: a number > 0 (one-line error otherwise)."""

    def parse(s: str) -> Any:
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
        return v

    return parse


def csv_choice(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: comma-separated subset of ``choices``."""

    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if x not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{s!r}: choose from {', '.join(choices)} (comma-separated)")
        return items

    return parse


# -- subprocesses --------------------------------------------------------------------------
def run_cmd(cmd: Sequence[str], what: str, timeout: float | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """Run ``cmd`` in the repo root; ``BenchError`` naming ``what`` with the stderr tail on failure."""
    full_env = {**os.environ, "MLLM_RL_NO_PROGRESS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    try:
        r = subprocess.run(list(cmd), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env)
    except subprocess.TimeoutExpired:
        raise BenchError(f"{what}: timed out after {timeout}s: {' '.join(cmd)}") from None
    if r.returncode != 0:
        raise BenchError(f"{what} failed (exit {r.returncode}): {' '.join(cmd)}\n{r.stderr[-3000:]}")
    return r


def is_oom(text: str) -> bool:
    low = text.lower()
    return any(m in low for m in OOM_MARKERS)


def last_json_line(stdout: str, what: str) -> dict[str, Any]:
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise BenchError(f"{what}: printed no JSON line")


def warm_page_cache(path: Path) -> dict[str, Any]:
    """Read every file under ``path`` once (so a later read comes from the page cache)."""
    t0, n = time.perf_counter(), 0
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb") as fh:
                while chunk := fh.read(64 * MiB):
                    n += len(chunk)
    dt = time.perf_counter() - t0
    return {"bytes": n, "seconds": round(dt, 3), "gbps": round(n / dt / 1e9, 3) if dt > 0 else None}


# -- phase records -------------------------------------------------------------------------
def truth(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The device-truth entry of each device (the first entry per id)."""
    seen, out = set(), []
    for d in devices:
        if d["id"] not in seen:
            seen.add(d["id"])
            out.append(d)
    return out


def allocator(devices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The torch allocator's entries (CUDA), else []."""
    return [d for d in devices if d.get("source") == "torch_allocator"]


def max_of(values: Sequence[int | None]) -> int | None:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


# -- tables --------------------------------------------------------------------------------
def fmt(v: Any, spec: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if spec and isinstance(v, (int, float)):
        return format(v, spec)
    return str(v)


def table(rows: Sequence[dict[str, Any]], cols: Sequence[tuple[str, str, str]]) -> str:
    """Plain-text table: ``cols`` = (key, header, format spec)."""
    cells = [[h for _, h, _ in cols]] + [[fmt(r.get(k), s) for k, _, s in cols] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
             for row in cells]  # fmt: skip
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def target(value: float | None, op: str, bound: float, applies: bool = True, why: str = "") -> dict[str, Any]:
    """A target check: ``pass`` is None when it does not apply (e.g. a GPU target on CPU)."""
    ok = None
    if applies and value is not None:
        ok = value <= bound if op == "<=" else value >= bound
    shown = int(bound) if float(bound).is_integer() and abs(bound) >= 1000 else bound
    out: dict[str, Any] = {"value": value, "target": f"{op} {shown}", "pass": ok}
    if not applies and why:
        out["not_applicable"] = why
    return out


# -- copy bandwidth baselines --------------------------------------------------------------
def _timed(fn: Callable[[], Any], repeats: int) -> list[float]:
    fn()  # warm-up: first-touch page faults, allocator growth, kernel load
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _bw(nbytes: int, times: list[float]) -> dict[str, Any]:
    best, med = min(times), statistics.median(times)
    return {"seconds_best": round(best, 6), "seconds_median": round(med, 6), "gbps_best": round(nbytes / best / 1e9, 3),
            "gbps_median": round(nbytes / med / 1e9, 3)}  # fmt: skip


def jax_copy_bandwidth(
    nbytes: int, repeats: int = 5, kinds: Sequence[str] = ("h2d", "d2h", "d2d")
) -> dict[str, Any]:
    """JAX: ``h2d`` = ``device_put`` of a pageable numpy buffer (new device buffer each time),
    ``d2h`` = ``device_get`` into a new numpy array, ``d2d`` = an on-device copy (``jnp.copy``).
    On JAX CPU every one of them is a host memcpy."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    dev = jax.devices()[0]
    host = np.full(nbytes, 1, np.uint8)  # touched: no first-touch faults inside the timing
    out: dict[str, Any] = {"runtime": "jax", "platform": dev.platform, "device": str(dev), "bytes": nbytes}
    on_dev = jax.device_put(host, dev)
    on_dev.block_until_ready()
    copy = jax.jit(jnp.copy)

    def h2d() -> None:
        a = jax.device_put(host, dev)
        a.block_until_ready()
        a.delete()

    def d2h() -> None:
        np.array(on_dev, copy=True)

    def d2d() -> None:
        a = copy(on_dev)
        a.block_until_ready()
        a.delete()

    fns = {"h2d": h2d, "d2h": d2h, "d2d": d2d}
    for k in kinds:
        out[k] = _bw(nbytes, _timed(fns[k], repeats))
    on_dev.delete()
    return out


def torch_copy_bandwidth(nbytes: int, device: str = "auto", repeats: int = 5,
                         kinds: Sequence[str] = ("h2d", "h2d_pinned", "d2h", "d2d")) -> dict[str, Any]:  # fmt: skip
    """torch: ``h2d`` = ``tensor.to(device)`` from pageable host memory, ``h2d_pinned`` = the same
    from pinned memory (CUDA only), ``d2h`` = ``.to("cpu")``, ``d2d`` = ``clone()`` on the device.
    On CPU ``.to("cpu")`` is a no-op, so ``h2d``/``d2h``/``d2d`` are a host ``clone()`` (memcpy)."""
    import torch

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    host = torch.ones(nbytes, dtype=torch.uint8)
    out: dict[str, Any] = {"runtime": "torch", "platform": dev.type, "bytes": nbytes,
                           "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}  # fmt: skip
    on_dev = host.to(dev) if cuda else host.clone()
    sync()

    def h2d() -> None:
        y = host.to(dev) if cuda else host.clone()
        sync()
        del y

    def d2h() -> None:
        y = on_dev.to("cpu") if cuda else on_dev.clone()
        del y

    def d2d() -> None:
        y = on_dev.clone()
        sync()
        del y

    fns: dict[str, Callable[[], None]] = {"h2d": h2d, "d2h": d2h, "d2d": d2d}
    if cuda and "h2d_pinned" in kinds:
        pinned = host.pin_memory()

        def h2d_pinned() -> None:
            y = pinned.to(dev, non_blocking=True)
            sync()
            del y

        fns["h2d_pinned"] = h2d_pinned
    for k in kinds:
        if k in fns:
            out[k] = _bw(nbytes, _timed(fns[k], repeats))
        else:
            out[k] = {"not_measured": "pinned host memory needs CUDA"}
    fns.clear()  # drops the closures' device buffers
    if cuda:
        torch.cuda.empty_cache()
    return out


def copy_bandwidth(backend: str, nbytes: int, platform_: str = "auto", repeats: int = 5) -> dict[str, Any]:
    if backend == "jax":
        if platform_ == "cpu":
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        out = jax_copy_bandwidth(nbytes, repeats)
    elif backend == "torch":
        out = torch_copy_bandwidth(nbytes, "cpu" if platform_ == "cpu" else "auto", repeats)
    else:
        raise BenchError(f"--backend {backend!r}: choose jax or torch")
    if out["platform"] == "cpu":
        out["note"] = ("CPU: every copy is a host-to-host memcpy; there is no host-to-device link, so "
                       "ratios against it are not H2D efficiencies")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Copy-bandwidth baselines for the benchmark scripts (one JSON line)."
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    cp = sub.add_parser("copy", help="host-to-device / device-to-host / on-device copy bandwidth")
    cp.add_argument("--backend", required=True, choices=["jax", "torch"])
    cp.add_argument("--mb", type=positive(float), default=1024.0, help="buffer size, MiB")
    cp.add_argument("--platform", default="auto", choices=["auto", "cpu", "gpu", "cuda", "tpu"])
    cp.add_argument("--repeats", type=positive(int), default=5)
    args = ap.parse_args(argv)
    try:
        out = copy_bandwidth(args.backend, int(args.mb * MiB), args.platform, args.repeats)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast this host hands a process fresh memory: right after a free, and after an idle pause.

    python -m mllm_rl.bench first-touch --mb 1024 [--idle 10] [--repeats 3] [--json OUT]

Each round fills ``--mb`` MiB of newly allocated memory (its own ``mmap``) twice: once right after
the same amount was freed, once after ``--idle`` seconds of sleep. A virtual machine whose balloon
driver reports free pages to its hypervisor (Linux ``page_reporting``) gives them back while the
process sleeps, and the first touch of each page then waits on the hypervisor: every copy into
fresh memory (a host copy, an offload, a checkpoint write) slows down by as much: one reason the
CPU figures of docs/BENCHMARKS.md vary between runs. Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mllm_rl.bench import MiB
from mllm_rl.bench.checkpoint_write import fresh_pages
from mllm_rl.bench.cli import positive
from mllm_rl.bench.machine import reported_kib


def fill_s(nbytes: int) -> float:
    """Seconds to allocate ``nbytes`` and write every page of it; the memory is freed after."""
    import numpy as np

    t0 = time.perf_counter()
    a = np.full(nbytes // 4, 1.0, dtype=np.float32)
    dt = time.perf_counter() - t0
    del a
    return dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=positive(int), default=1024, help="MiB per fill (default 1024)")
    ap.add_argument("--idle", type=positive(float), default=10.0, help="seconds of sleep (default 10)")
    ap.add_argument("--repeats", type=positive(int), default=3)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    fresh_pages()  # every fill its own mmap, whatever its size (off glibc: as the allocator does)
    nbytes, before = args.mb * MiB, reported_kib()
    fill_s(nbytes)  # the first fill: whatever state the memory was in
    warm, idle = [], []
    for _ in range(args.repeats):
        warm.append(fill_s(nbytes))
        time.sleep(args.idle)
        idle.append(fill_s(nbytes))
    after = reported_kib()
    med = {
        "right after a free": statistics.median(warm),
        f"after {args.idle:g} s idle": statistics.median(idle),
    }
    for way, s in med.items():
        print(f"{way:>24}: {s:8.3f} s  {nbytes / s / 1e9:7.2f} GB/s")
    out = {"bench": "first_touch", "bytes": nbytes, "idle_s": args.idle, "median_s": med,
           "idle_over_warm": round(med[f"after {args.idle:g} s idle"] / med["right after a free"], 2),
           "reported_kib": None if before is None or after is None else after - before}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0

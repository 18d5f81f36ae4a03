"""What a torch checkpoint write costs next to a copy of the same state in host memory.

    .venv-torch/bin/python -m mllm_rl.bench checkpoint-write --mb 1024 [--repeats 3] [--json OUT]

On ``--mb`` MiB of float32 tensors (64, like params and AdamW moments), interleaved round by round:
a host copy (the floor), ``torch.save`` + a manifest reading the file back, one file hashed while
written (with and without CRC32s), the trainer's ``state_file.write_state`` (``--shards`` files at
once; default as the trainer chooses), that synced to disk, and that synced with the written pages
kept in the page cache (not dropped every ``DROP_EVERY`` bytes). Medians over ``--repeats``; a CPU
figure of this machine's disk and page cache.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from mllm_rl.bench import MiB
from mllm_rl.bench.cli import positive
from mllm_rl.bench.tables import table
from mllm_rl.checkpoint.resolve import file_manifest, sync_tree

TENSORS = 64


def state_of(mb: int) -> dict[str, Any]:
    import torch  # here: no module of mllm_rl imports a framework at import

    n = mb * MiB // 4 // TENSORS
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(n, generator=g) for i in range(TENSORS)}


def fresh_pages() -> bool:
    """Every allocation of 128 KiB or more its own ``mmap`` (glibc's ``M_MMAP_THRESHOLD``), so every
    way's copies land in fresh pages as a large model's do (docs/BENCHMARKS.md); False off glibc."""
    try:
        return ctypes.CDLL("libc.so.6").mallopt(-3, 128 << 10) == 1  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def read_back(state: dict[str, Any], d: Path) -> None:
    import torch

    torch.save(state, d / "state.pt")
    file_manifest(d)


def hashed_while_written(
    state: dict[str, Any], d: Path, shards: int, crc32: bool = False, sync: bool = False, keep: bool = False
) -> None:
    """``write_state`` (``keep``: its written pages left in the page cache, not dropped as written)."""
    from mllm_rl.backends.torch.state_file import DROP_EVERY, write_state

    known = write_state(state, d, crc32=crc32, shards=shards, drop_every=None if keep else DROP_EVERY)
    if sync:
        sync_tree(d)
    file_manifest(d, known)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=positive(int), default=1024, help="state size in MiB (default 1024)")
    ap.add_argument("--repeats", type=positive(int), default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary dir)")
    ap.add_argument(
        "--shards", type=positive(int), help="files of the trainer's write (default: as it chooses)"
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    from mllm_rl.backends.torch.state_file import shard_count

    fresh = fresh_pages()
    state = state_of(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    files = args.shards or shard_count(nbytes)
    ways = {
        "host copy": lambda d: {name: t.clone() for name, t in state.items()},
        "save + read back": lambda d: read_back(state, d),
        "save + CRC32s, hashed while written": lambda d: hashed_while_written(state, d, 1, crc32=True),
        "save, hashed while written": lambda d: hashed_while_written(state, d, 1),
        f"the trainer's: {files} files at once": lambda d: hashed_while_written(state, d, files),
        "the same, synced to disk": lambda d: hashed_while_written(state, d, files, sync=True),
        "the same, pages kept in the page cache": lambda d: hashed_while_written(
            state, d, files, sync=True, keep=True
        ),
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for _ in range(args.repeats):
            for name, fn in ways.items():
                d = Path(tempfile.mkdtemp(dir=tmp))
                t0 = time.perf_counter()
                fn(d)
                times[name].append(time.perf_counter() - t0)
                shutil.rmtree(d)
    med = {k: statistics.median(v) for k, v in times.items()}
    base = med["host copy"]
    print(
        f"CPU figure: {nbytes / 2**30:.2f} GiB of float32 state, median of {args.repeats} interleaved rounds"
        + ("" if fresh else " (allocations may reuse pages: not glibc)")
    )
    rows = [{"way": k, "s": v, "x": v / base, "gbps": nbytes / v / 1e9} for k, v in med.items()]
    print(table(rows, [("way", "way", ""), ("s", "seconds", ".3f"), ("x", "x host copy", ".2f"),
                       ("gbps", "GB/s", ".2f")]))  # fmt: skip
    out = {"bench": "checkpoint_write", "figure": "CPU", "bytes": nbytes, "shards": files, "fresh_pages": fresh,
           "median_s": med,
           "x_host_copy": {k: round(v / base, 3) for k, v in med.items()}}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0

"""What a trainer's checkpoint write costs next to a copy of the same state in host memory.

    .venv-torch/bin/python -m mllm_rl.bench checkpoint-write --mb 1024 [--repeats 3] [--json OUT]
    .venv-jax/bin/python -m mllm_rl.bench checkpoint-write --framework jax --mb 1024

On ``--mb`` MiB of float32 tensors (64, like params and AdamW moments), interleaved round by round.
torch: a host copy (the floor), ``torch.save`` + a manifest reading the file back, one file hashed
while written (with and without CRC32s), the trainer's ``state_file.write_state`` (``--shards``
files at once; default as the trainer chooses), that synced to disk, and that synced with the
written pages kept in the page cache (not dropped every ``DROP_EVERY`` bytes). jax: a host copy,
then orbax's save as the trainer's ``checkpoint`` phase makes it (written, synced, the manifest
read back), raw (the trainer's default) and zstd-compressed (``--checkpoint-compression``, orbax's
own default). Medians over ``--repeats``; a figure of this machine's disk and page cache.
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


def orbax_saved(tree: Any, d: Path, compress: bool) -> None:
    """The JAX trainer's ``checkpoint`` phase on ``tree``: orbax's save, synced, the manifest."""
    from mllm_rl.backends.jax.orbax_io import AsyncSave

    AsyncSave(d / "state", tree, compress=compress).write()
    sync_tree(d)
    file_manifest(d)


def jax_ways(mb: int) -> tuple[int, dict[str, Any], str]:
    """The JAX ways on ``mb`` MiB of random float32 arrays (a trained state: zstd finds little),
    and the platform they are on (``CPU``, ``GPU``, ...)."""
    import jax
    import numpy as np

    n = mb * MiB // 4 // TENSORS
    keys = jax.random.split(jax.random.key(0), TENSORS)
    tree = {f"t{i}": jax.random.normal(k, (n,)) for i, k in enumerate(keys)}
    jax.block_until_ready(tree)
    ways = {
        "host copy": lambda d: [np.array(x, copy=True) for x in tree.values()],
        "the trainer's: orbax, raw, synced + manifest": lambda d: orbax_saved(tree, d, False),
        "orbax, zstd (--checkpoint-compression)": lambda d: orbax_saved(tree, d, True),
    }
    return sum(int(x.nbytes) for x in tree.values()), ways, jax.devices()[0].platform.upper()


def torch_ways(mb: int, shards: int | None) -> tuple[int, dict[str, Any], int]:
    """The torch ways (module docstring) and the trainer's file count."""
    from mllm_rl.backends.torch.state_file import shard_count

    state = state_of(mb)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    files = shards or shard_count(nbytes)
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
    return nbytes, ways, files


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=positive(int), default=1024, help="state size in MiB (default 1024)")
    ap.add_argument("--repeats", type=positive(int), default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary dir)")
    ap.add_argument(
        "--shards", type=positive(int), help="files of the trainer's write (default: as it chooses)"
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--framework", choices=("torch", "jax"), default="torch",
                    help="whose trainer's write (default torch; jax: orbax, raw and zstd)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.framework == "jax" and args.shards:
        ap.error("--shards: the torch trainer's file count; orbax lays out its own files")
    fresh = fresh_pages()
    if args.framework == "jax":
        (nbytes, ways, figure), files = jax_ways(args.mb), None
    else:
        (nbytes, ways, files), figure = torch_ways(args.mb, args.shards), "CPU"
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
        f"{figure} figure: {nbytes / 2**30:.2f} GiB of float32 state, median of {args.repeats} interleaved rounds"
        + ("" if fresh else " (allocations may reuse pages: not glibc)")
    )
    rows = [{"way": k, "s": v, "x": v / base, "gbps": nbytes / v / 1e9} for k, v in med.items()]
    print(table(rows, [("way", "way", ""), ("s", "seconds", ".3f"), ("x", "x host copy", ".2f"),
                       ("gbps", "GB/s", ".2f")]))  # fmt: skip
    out = {"bench": "checkpoint_write", "framework": args.framework, "figure": figure, "bytes": nbytes,
           "shards": files, "fresh_pages": fresh,
           "median_s": med,
           "x_host_copy": {k: round(v / base, 3) for k, v in med.items()}}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0

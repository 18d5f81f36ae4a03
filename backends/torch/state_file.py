"""The torch trainer's checkpoint files: ``state.pt`` (the structure, shard 0's tensors and a
``(SHARD_REF, i, key)`` for each other) and for a large state ``state.i.pt`` (``{key: tensor}``),
each written and sha256-hashed by its own thread (docs/BENCHMARKS.md), renamed once all are written.
Every ``DROP_EVERY`` bytes a file's written pages are synced and dropped from the page cache.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from mllm_rl.trainer import Manifest

STATE_FILE = "state.pt"
SHARD_REF = "mllm_rl.state_shard"  # first item of a reference tuple in state.pt
SHARD_MIN_BYTES = 64 << 20  # no shard smaller than this (a tiny state stays one file)
MAX_SHARDS = 8
# Written bytes after which a file's pages are synced and dropped from the page cache (what
# PostgreSQL's checkpoint_flush_after does): gigabytes of dirty checkpoint pages otherwise stall
# the writer at the kernel's dirty limit and the run's allocations behind it (docs/BENCHMARKS.md).
DROP_EVERY = 256 << 20


def shard_file(i: int) -> str:
    return STATE_FILE if i == 0 else f"state.{i}.pt"


def shard_count(nbytes: int) -> int:
    """Files for a state of ``nbytes``: one per usable core, at most ``MAX_SHARDS``, each >= ``SHARD_MIN_BYTES``."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, MAX_SHARDS, nbytes // SHARD_MIN_BYTES))


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` (dicts, lists, tuples, leaves) with every tensor replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        if isinstance(obj, tuple) and obj[:1] == (SHARD_REF,):
            return fn(obj)  # type: ignore[arg-type]
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def split(state: dict[str, Any], k: int) -> list[Any]:
    """``state`` as ``k`` objects to save: the structure (with shard 0's tensors) and ``{key:
    tensor}`` per other shard; whole storages, largest first to the lightest shard."""
    tensors = tensors_of(state)
    storages: dict[int, list[int]] = {}
    for key, t in enumerate(tensors):
        storages.setdefault(t.untyped_storage().data_ptr(), []).append(key)
    load, where = [0] * k, {}
    size = {ptr: tensors[keys[0]].untyped_storage().nbytes() for ptr, keys in storages.items()}
    for ptr in sorted(storages, key=lambda p: -size[p]):
        shard = load.index(min(load))
        load[shard] += size[ptr]
        where.update((key, shard) for key in storages[ptr])
    shards: list[Any] = [None] + [{} for _ in range(1, k)]
    keys = iter(range(len(tensors)))

    def place(t: torch.Tensor) -> Any:
        key = next(keys)
        if where[key] == 0:
            return t
        shards[where[key]][key] = t
        return (SHARD_REF, where[key], key)

    shards[0] = _map_tensors(state, place)
    return shards


def load_state(path: Path, map_location: Any = "cpu") -> dict[str, Any]:
    """The state ``write_state`` wrote into ``path``; ValueError naming a missing shard or tensor."""
    state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)
    shards: dict[int, dict[int, torch.Tensor]] = {}

    def resolve(ref: Any) -> torch.Tensor:
        if isinstance(ref, torch.Tensor):
            return ref
        _, i, key = ref
        if i not in shards:
            f = path / shard_file(i)
            if not f.exists():
                raise ValueError(f"{f}: missing ({STATE_FILE} refers to it)")
            shards[i] = torch.load(f, map_location=map_location, weights_only=True)
        if key not in shards[i]:
            raise ValueError(f"{path / shard_file(i)}: no tensor {key} ({STATE_FILE} refers to it)")
        return shards[i][key]

    return _map_tensors(state, resolve)


def write_state(
    state: dict[str, Any],
    path: Path,
    crc32: bool = False,
    shards: int | None = None,
    drop_every: int | None = DROP_EVERY,
) -> Manifest:
    """``state`` into ``path`` as ``shards`` files (default ``shard_count``) under temporary names, all
    renamed once all are written, all removed when one fails (its ``OSError`` raised, naming the
    file). Returns the manifest entries; no torch CRC32s unless ``crc32`` (sha256 is the checksum);
    ``drop_every`` None: written pages stay in the page cache."""
    if shards is None:
        shards = shard_count(sum(t.nbytes for t in tensors_of(state)))
    objs = split(state, shards)
    targets = [path / shard_file(i) for i in range(shards)]
    tmps = [t.with_name(f".{t.name}.tmp") for t in targets]
    with contextlib.nullcontext() if crc32 else _without_crc32():
        save = functools.partial(_save, drop_every=drop_every)
        if shards == 1:
            results = [save(objs[0], tmps[0])]
        else:
            with ThreadPoolExecutor(shards, thread_name_prefix="checkpoint-write") as pool:
                results = list(pool.map(save, objs, tmps))
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is None:
        try:
            for tmp, target in zip(tmps, targets, strict=True):
                os.replace(tmp, target)
        except BaseException as e:
            failed = e
    if failed is not None:
        for f in (*tmps, *targets):
            f.unlink(missing_ok=True)
        raise failed
    return {t.name: r for t, r in zip(targets, results, strict=True)}


def tensors_of(state: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    _map_tensors(state, out.append)
    return out


def _save(obj: Any, tmp: Path, drop_every: int | None) -> dict[str, Any] | BaseException:
    """``torch.save`` of ``obj`` to ``tmp``: its manifest entry, or the exception that stopped it."""
    try:
        with open(tmp, "wb") as f, _HashingFile(f, drop_every) as out:
            try:
                torch.save(obj, out)
            except RuntimeError:
                if out.error is None:
                    raise
                raise out.error from None
        return {"bytes": out.nbytes, "sha256": out.sha256.hexdigest()}
    except OSError as e:
        if e.filename is None and e.errno is not None:  # a write() or close() of the open file
            return OSError(e.errno, e.strerror, str(tmp))
        return e
    except BaseException as e:
        return e


@contextlib.contextmanager
def _without_crc32() -> Iterator[None]:
    """``torch.save`` without CRC32s in the zip records for the block (torch's option is global)."""
    from torch.serialization import get_crc32_options, set_crc32_options

    was = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(was)


class _HashingFile:
    """The file ``torch.save`` writes to: each buffer hashed as written (on a second thread), the
    written pages synced and dropped from the page cache every ``drop_every`` bytes (None: never),
    and the first ``OSError`` kept (torch's writer turns it into a ``RuntimeError`` without reason)."""

    INLINE = 1 << 20  # smaller buffers are hashed on the writing thread

    def __init__(self, f: Any, drop_every: int | None) -> None:
        self.f, self.error, self.nbytes, self.sha256 = f, None, 0, hashlib.sha256()
        self.drop_every, self._dropped = drop_every, 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-hash")

    def __enter__(self) -> _HashingFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.shutdown()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        hashed = self._pool.submit(self.sha256.update, view) if view.nbytes >= self.INLINE else None
        try:
            n = self.f.write(view)
        except OSError as e:
            self.error = self.error or e
            raise
        finally:
            if hashed is not None:
                hashed.result()
        if hashed is None:
            self.sha256.update(view)
        self.nbytes += view.nbytes
        if self.drop_every is not None and self.nbytes - self._dropped >= self.drop_every:
            self._drop_written()
        return n

    def _drop_written(self) -> None:
        """Sync what was written and drop it from the page cache (a checkpoint is not read back
        soon; the final ``fsync`` then has little left to wait for)."""
        try:
            self.f.flush()
            fd = self.f.fileno()
            getattr(os, "fdatasync", os.fsync)(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # 0, 0: the whole file so far
        except OSError as e:
            self.error = self.error or e
            raise
        self._dropped = self.nbytes

    def flush(self) -> None:
        try:
            self.f.flush()
        except OSError as e:
            self.error = self.error or e
            raise

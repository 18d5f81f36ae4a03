"""Memory-plan figures kept on disk between processes, for both backends' planners.

What a planner measures (the torch planner's fake-tensor trace of the train step, the JAX planner's
compiled trainer functions and engine layout) is a function of its arguments, this package's source
and the frameworks' versions alone, and it takes seconds (tiny) to minutes (an 8B model for a TPU
slice); every run plans itself before it starts, so a run started again or resumed would measure the
same again. ``load``/``store`` keep each measurement's figures under a key of all three: an edited
source file or another framework version is another key, never a stale entry.

``MLLM_RL_PLAN_CACHE``: the directory; unset: ``$MLLM_RL_CACHE/plans``; empty: off. At most
``MAX_ENTRIES`` are kept, the oldest deleted first.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from mllm_rl.checkpoint.resolve import cache_dir

ENV = "MLLM_RL_PLAN_CACHE"
MAX_ENTRIES = 1000  # about 1-4 KB each; past it, a store deletes the oldest down to 3/4 of it


def directory(env: Mapping[str, str] = os.environ) -> Path | None:
    """Where entries live; None when the cache is off."""
    if ENV in env:
        return Path(env[ENV]).expanduser() if env[ENV] else None
    return cache_dir(env) / "plans"


def source_roots() -> tuple[Path, ...]:
    """The ``mllm_rl`` package and its backends (``backends/`` in a checkout)."""
    import mllm_rl
    import mllm_rl.backends

    return Path(mllm_rl.__file__).parent, Path(mllm_rl.backends.__file__).parent


def digest(roots: tuple[Path, ...]) -> str:
    """sha256 of the names and bytes of every Python file under ``roots``."""
    h = hashlib.sha256()
    for root in roots:
        for f in sorted(root.rglob("*.py")):
            h.update(str(f.relative_to(root.parent)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """``digest`` of this package's source, once per process."""
    return digest(source_roots())


def versions(dists: Iterable[str]) -> dict[str, str | None]:
    """The installed version of each distribution (None where it is not installed)."""
    out: dict[str, str | None] = {}
    for d in dists:
        try:
            out[d] = importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            out[d] = None
    return out


def key(args: Mapping[str, Any], dists: Iterable[str]) -> str:
    """The entry name of a measurement of ``args`` (JSON-able values) by this source and the
    installed versions of ``dists``."""
    doc = {"args": args, "versions": versions(dists), "source": source_digest()}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def load(name: str, env: Mapping[str, str] = os.environ) -> dict[str, Any] | None:
    """The stored figures of ``name``, or None (cache off, no entry, or one that does not parse)."""
    where = directory(env)
    if where is None:
        return None
    try:
        doc = json.loads((where / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def store(name: str, figures: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> None:
    """Keep ``figures`` under ``name`` (written whole, then renamed: a reader never sees half an
    entry); best effort: a cache that cannot be written only costs the next run a measurement."""
    where = directory(env)
    if where is None:
        return
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, suffix=".tmp")
    except OSError:
        return
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(figures, f)
        os.replace(tmp, where / f"{name}.json")
    except (OSError, TypeError, ValueError):
        Path(tmp).unlink(missing_ok=True)
        return
    _trim(where)


def _trim(where: Path) -> None:
    """Past ``MAX_ENTRIES``, delete the oldest down to 3/4 of it (the newest kept): entries of
    edited code are never read again."""
    try:
        entries = sorted(where.glob("*.json"), key=lambda f: f.stat().st_mtime)
        if len(entries) > MAX_ENTRIES:
            for f in entries[: len(entries) - max(1, MAX_ENTRIES * 3 // 4)]:
                f.unlink(missing_ok=True)
    except OSError:
        return

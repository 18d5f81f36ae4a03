"""JAX's persistent compilation cache, on for every run unless the caller chose otherwise.

``JAX_COMPILATION_CACHE_DIR`` unset defaults to ``$MLLM_RL_CACHE/jax-compile``; empty turns it off.
That directory is kept under ``DEFAULT_MAX_BYTES`` by ``trim`` once per run, not by JAX's
``JAX_COMPILATION_CACHE_MAX_SIZE`` (whose eviction scans the directory under a lock on every write).
A caller who set either variable chose the policy. JAX reads them at import: ``configure`` runs first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from mllm_rl.checkpoint.resolve import cache_dir

DIR = "JAX_COMPILATION_CACHE_DIR"
MAX_SIZE = "JAX_COMPILATION_CACHE_MAX_SIZE"
DEFAULT_MAX_BYTES = 4 * 2**30
ENTRY, ATIME = "-cache", "-atime"  # JAX's file name suffixes: a program, its last use (JAX's eviction)


def configure(env: MutableMapping[str, str] | None = None) -> str | None:
    """Default ``env``'s cache directory (not once jax is imported), trimmed when ours; None: off."""
    env = os.environ if env is None else env
    if env is os.environ and "jax" in sys.modules:
        return env.get(DIR) or None
    if DIR not in env:
        env[DIR] = str(cache_dir(env) / "jax-compile")
        if MAX_SIZE not in env:
            trim(Path(env[DIR]), DEFAULT_MAX_BYTES)
    return env[DIR] or None


def trim(path: Path, max_bytes: int) -> int:
    """Over ``max_bytes``: delete the programs used longest ago until the rest fit in 3/4 of it.
    Returns the bytes deleted; best effort (a file that cannot be removed is skipped)."""
    entries = []
    for f in path.glob(f"*{ENTRY}") if path.is_dir() else ():
        try:
            st = f.stat()
        except OSError:
            continue
        entries.append((max(st.st_atime, st.st_mtime), st.st_size, f))
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes:
        return 0
    freed = 0
    for _, size, f in sorted(entries, key=lambda e: e[0]):
        if total - freed <= max_bytes * 3 // 4:
            break
        try:
            f.unlink()
            freed += size
        except OSError:
            continue
        f.with_name(f.name.removesuffix(ENTRY) + ATIME).unlink(missing_ok=True)
    return freed

"""JAX's persistent compilation cache, on for every run unless the caller chose otherwise.

A run compiles its memory plan, trainer and engine programs; with the cache, a later run of the
same configuration on the same machine reads the compiled programs instead of compiling again
(step 0 of a run on an accelerator spends most of its time compiling). JAX's own variables decide
(https://docs.jax.dev/en/latest/persistent_compilation_cache.html); ``JAX_COMPILATION_CACHE_DIR``
unset defaults to ``$MLLM_RL_CACHE/jax-compile`` (``~/.cache/mllm_rl/...``); empty turns the cache
off. That directory is kept under ``DEFAULT_MAX_BYTES`` by ``trim`` once per run (the entries used
longest ago go first), not by JAX's ``JAX_COMPILATION_CACHE_MAX_SIZE``, whose eviction lists the
directory and reads every entry's access time, under a file lock, on every write: a cost per
compiled program that grows with the cache. A caller who chose the directory or that variable
chose the policy.

JAX reads them when it is imported, so ``configure`` runs before anything imports jax.
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
    """Default ``env``'s cache directory (``os.environ``; left alone once jax is imported, when it
    no longer applies) and ``trim`` it when it is ours. Returns the directory, None when off."""
    env = os.environ if env is None else env
    if env is os.environ and "jax" in sys.modules:
        return env.get(DIR) or None
    if DIR not in env:
        env[DIR] = str(cache_dir(env) / "jax-compile")
        if MAX_SIZE not in env:
            trim(Path(env[DIR]), DEFAULT_MAX_BYTES)
    return env[DIR] or None


def trim(path: Path, max_bytes: int) -> int:
    """Delete the compiled programs in ``path`` used longest ago (file access or write time,
    whichever is later) until the rest fit in three quarters of ``max_bytes``, if they exceed
    ``max_bytes``. Returns the bytes deleted. Best effort: a file another process removed or
    cannot be removed is skipped."""
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

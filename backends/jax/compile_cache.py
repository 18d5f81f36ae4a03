"""JAX's persistent compilation cache, on for every run unless the caller chose otherwise.

A run compiles its memory plan, trainer and engine programs; with the cache, a later run of the
same configuration on the same machine reads the compiled programs instead of compiling again
(step 0 of a run on an accelerator spends most of its time compiling). JAX's own variables decide
(https://docs.jax.dev/en/latest/persistent_compilation_cache.html); unset, they default to:

- ``JAX_COMPILATION_CACHE_DIR``: ``$MLLM_RL_CACHE/jax-compile`` (``~/.cache/mllm_rl/...``); set it
  empty to turn the cache off;
- ``JAX_COMPILATION_CACHE_MAX_SIZE``: ``DEFAULT_MAX_BYTES``, least recently used entries evicted
  (JAX needs ``filelock`` for that; without it the cache is unbounded). Only with our directory: a
  caller who chose the directory chose its policy too.

JAX reads them when it is imported, so ``configure`` runs before anything imports jax.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import MutableMapping

from mllm_rl.checkpoint.resolve import cache_dir

DIR = "JAX_COMPILATION_CACHE_DIR"
MAX_SIZE = "JAX_COMPILATION_CACHE_MAX_SIZE"
DEFAULT_MAX_BYTES = 4 * 2**30


def configure(env: MutableMapping[str, str] | None = None) -> str | None:
    """Default ``env``'s cache variables (``os.environ``; left alone once jax is imported, when they
    no longer apply). Returns the cache directory, None when the cache is off."""
    env = os.environ if env is None else env
    if env is os.environ and "jax" in sys.modules:
        return env.get(DIR) or None
    if DIR not in env:
        env[DIR] = str(cache_dir(env) / "jax-compile")
        if importlib.util.find_spec("filelock") is not None:
            env.setdefault(MAX_SIZE, str(DEFAULT_MAX_BYTES))
    return env[DIR] or None

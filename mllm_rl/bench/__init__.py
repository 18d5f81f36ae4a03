"""The benchmarks, one module each, run by ``python -m mllm_rl.bench NAME [ARGS...]`` (``NAME``: the
module's name with hyphens, e.g. ``rl-memory`` for ``rl_memory``; ``copy`` for ``copy_bandwidth``);
``python -m mllm_rl.bench`` lists them (``__main__``). Each has ``main(argv) -> int``.

Shared: ``machine`` (what ran), ``child`` (child processes), ``records``, ``cli``, ``tables``. No
module here imports jax or torch at module level."""

from __future__ import annotations

GiB = 2**30
MiB = 2**20

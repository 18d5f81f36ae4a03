"""The benchmarks, one module each, run by ``python -m mllm_rl.bench NAME [ARGS...]`` (``NAME``: the
module's name with hyphens, e.g. ``rl-memory`` for ``rl_memory``; ``copy`` for ``copy_bandwidth``);
``python -m mllm_rl.bench`` lists them (``__main__``). Each has ``main(argv) -> int``.

The modules they share, one concern each: ``machine`` (what ran), ``child`` (child processes and
their JSON line), ``records``, ``cli`` (argparse types and ``run_bench``), ``tables``. ``step_cost``
and ``copy_bandwidth`` are benchmarks whose functions other modules use too. No module here imports
jax or torch at module level (each benchmark imports them where it uses them)."""

from __future__ import annotations

GiB = 2**30
MiB = 2**20

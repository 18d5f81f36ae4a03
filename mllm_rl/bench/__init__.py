"""Shared pieces of the benchmark scripts (``scripts/bench_*.py``, ``scripts/soak.py``), one concern
per module: ``machine`` (what ran), ``child`` (child processes and their JSON line), ``records``,
``cli`` (argparse types and ``run_bench``), ``tables``, ``copy_bandwidth`` (``python -m
mllm_rl.bench copy``) and ``step_cost``. Nothing here imports jax or torch at module level."""

from __future__ import annotations

GiB = 2**30
MiB = 2**20

"""Shared pieces of the benchmark scripts (``scripts/bench_*.py``, ``scripts/soak.py``), one concern
per module. Nothing here imports jax or torch at module level.

- ``machine``: what ran (host, GPUs, package versions, git commit, load) and the command line;
- ``child``: running a child process (a run, a worker, a baseline) and reading its JSON line;
- ``records``: reading phase records (device truth, allocator entries);
- ``cli``: argparse types, target checks and ``run_bench``, the shared end of every script;
- ``tables``: plain-text tables;
- ``copy_bandwidth``: host/device copy baselines (``python -m mllm_rl.bench copy ...``);
- ``step_cost``: the share of each lifecycle phase in an RL step (``scripts/bench_step_cost.py``).
"""

from __future__ import annotations

GiB = 2**30
MiB = 2**20

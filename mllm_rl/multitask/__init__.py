"""Several RL tasks (each its own model, engine and trainer) on the same devices: ``docs/MULTITASK.md``.

``spec`` (the ``--tasks`` TOML file), ``schedule`` (the lease order), ``coord`` (agreement between
processes), ``driver`` (runs the leases), ``runtime`` (one RL task), ``ports`` (one allocator),
``main`` (``python -m mllm_rl.run --tasks FILE``).
"""

from __future__ import annotations

from typing import Any


def main(args: Any, argv: list[str] | None = None) -> int:
    """Entry point from ``python -m mllm_rl.run`` when ``--tasks`` is given."""
    from mllm_rl.multitask.main import main as run_tasks

    return run_tasks(args, argv)

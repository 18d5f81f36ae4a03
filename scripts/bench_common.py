"""Deprecated: the shared benchmark helpers live in the package ``mllm_rl.bench`` now; import
them from there (``from mllm_rl.bench.cli import run_bench``). This module only re-exports
them for scripts that still put ``scripts/`` on ``sys.path``; it will be removed.

    python scripts/bench_common.py copy ...   is   python -m mllm_rl.bench copy ...
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # as before: the repo without an install
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mllm_rl.bench import GiB, MiB  # noqa: E402
from mllm_rl.bench.child import OOM_MARKERS, BenchError, is_oom, last_json_line, run_cmd, warm_page_cache  # noqa: E402
from mllm_rl.bench.cli import csv_choice, failed_targets, positive, run_bench, target, write_json  # noqa: E402
from mllm_rl.bench.copy_bandwidth import copy_bandwidth, jax_copy_bandwidth, main, torch_copy_bandwidth  # noqa: E402
from mllm_rl.bench.machine import GIT_AT_START, PACKAGES, ROOT, command_line, machine_info  # noqa: E402
from mllm_rl.bench.records import allocator, max_of, truth  # noqa: E402
from mllm_rl.bench.tables import fmt, table  # noqa: E402

__all__ = ["GIT_AT_START", "OOM_MARKERS", "PACKAGES", "ROOT", "BenchError", "GiB", "MiB", "allocator",
           "command_line", "copy_bandwidth", "csv_choice", "failed_targets", "fmt", "is_oom",
           "jax_copy_bandwidth", "last_json_line", "machine_info", "main", "max_of", "positive", "run_bench",
           "run_cmd", "table", "target", "torch_copy_bandwidth", "truth", "warm_page_cache", "write_json"]  # fmt: skip

if __name__ == "__main__":
    sys.exit(main())
warnings.warn(
    "scripts/bench_common.py is deprecated: import from mllm_rl.bench", DeprecationWarning, stacklevel=2
)

"""The benchmark driver: ``python -m mllm_rl.bench NAME [ARGS...]`` runs the benchmark ``NAME`` (a
module of this package) with ``ARGS``; ``python -m mllm_rl.bench`` (or ``--help``) lists them, each
with the first line of its module docstring, read without importing it (most import jax or torch).
``python -m mllm_rl.bench NAME --help``: that benchmark's flags. An unknown ``NAME``: one line on
stderr, exit 2."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

PROG = "python -m mllm_rl.bench"
# name on the command line -> the module that is that benchmark (each has ``main(argv) -> int``)
BENCHES: dict[str, str] = {
    "checkpoint-write": "mllm_rl.bench.checkpoint_write",
    "copy": "mllm_rl.bench.copy_bandwidth",
    "engine": "mllm_rl.bench.engine",
    "model-paths": "mllm_rl.bench.model_paths",
    "multitask": "mllm_rl.bench.multitask",
    "plan": "mllm_rl.bench.plan",
    "precision": "mllm_rl.bench.precision",
    "processes": "mllm_rl.bench.processes",
    "release": "mllm_rl.bench.release",
    "report": "mllm_rl.bench.report",
    "rl-memory": "mllm_rl.bench.rl_memory",
    "soak": "mllm_rl.bench.soak",
    "step-cost": "mllm_rl.bench.step_cost",
    "summary": "mllm_rl.bench.summary",
    "swap": "mllm_rl.bench.swap",
    "torch-attention": "mllm_rl.bench.torch_attention",
}


def describe(module: str) -> str:
    """The first line of ``module``'s docstring (without RST double backquotes), read from its source:
    the module is not imported."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return "(not found)"
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8")))
    return doc.strip().splitlines()[0].replace("``", "") if doc and doc.strip() else ""


def listing() -> str:
    """The usage line and every benchmark with its description (what ``--help`` prints)."""
    width = max(map(len, BENCHES))
    lines = [f"usage: {PROG} NAME [ARGS...]    ({PROG} NAME --help: the flags of NAME)", "", "benchmarks:"]
    lines += [f"  {name:<{width}}  {describe(module)}" for name, module in BENCHES.items()]
    lines += ["", "Details: docs/BENCHMARKS.md"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """List the benchmarks, or run one: its ``main`` with the arguments after its name, under
    ``sys.argv[0]`` = ``python -m mllm_rl.bench NAME`` (argparse's prog, and the command line a
    benchmark's JSON records). A benchmark whose module sets ``HARD_EXIT`` (it ran an engine whose
    threads abort interpreter teardown) leaves through ``cli.hard_exit``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(listing())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in BENCHES:
        print(f"error: unknown benchmark {name!r} (choose from {', '.join(BENCHES)})", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHES[name])
    sys.argv = [f"{PROG} {name}", *rest]
    code = module.main(rest)
    if getattr(module, "HARD_EXIT", False):
        from mllm_rl.bench.cli import hard_exit

        hard_exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())

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
# each module of these has ``main(argv) -> int``; its name on the command line has hyphens
MODULES = ("checkpoint_write", "copy_bandwidth", "engine", "first_touch", "model_paths", "multitask", "plan", "precision",
           "processes", "release", "report", "rl_memory", "soak", "step_cost", "summary", "swap", "torch_attention")  # fmt: skip
BENCHES = {("copy" if m == "copy_bandwidth" else m.replace("_", "-")): f"mllm_rl.bench.{m}" for m in MODULES}


def describe(module: str) -> str:
    """The first line of ``module``'s docstring (no double backquotes), read without importing it."""
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
    """List the benchmarks, or run one under ``sys.argv[0]`` = ``python -m mllm_rl.bench NAME`` (its
    prog, and the command its JSON records); a module with ``HARD_EXIT`` leaves by ``cli.hard_exit``."""
    if argv is None:  # a process of its own: once more with huge pages, as a run (no return)
        from mllm_rl.hugepages import restart_with_hugepages

        restart_with_hugepages("mllm_rl.bench")
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

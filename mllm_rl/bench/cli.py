"""The command-line pieces the benchmarks share: argparse types, target checks, and ``run_bench``,
their common end (report, ``--json``, one JSON summary line, exit code)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mllm_rl.bench.child import BenchError

PLATFORMS = ["auto", "cpu", "gpu", "cuda", "tpu"]
Results = dict[str, Any]


def doc_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the docstring's first paragraph as description, the rest after the options."""
    head, _, rest = doc.partition("\n\n")
    return argparse.ArgumentParser(
        description=head, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=rest
    )


def bench_parser(doc: str, backend: str | None = "jax") -> argparse.ArgumentParser:
    """A parser with the flags most benchmarks share: ``--backend`` (default ``backend``; required
    when None), ``--preset``, ``--platform``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog="Details: docs/BENCHMARKS.md")
    ap.add_argument("--backend", default=backend, required=backend is None, choices=["jax", "torch"])
    ap.add_argument(
        "--preset", default="tiny", help="preset (written once to $MLLM_RL_CACHE) or checkpoint dir"
    )
    ap.add_argument("--platform", default="auto", choices=PLATFORMS)
    return ap


def output_flags(
    ap: argparse.ArgumentParser, timeout: float | None = 3600.0, per: str = "run", extra: str = ""
) -> None:
    """``--timeout`` (seconds per ``per``; none when None), ``--json`` and, when ``extra`` (its help),
    the arguments after ``--`` for ``mllm_rl.run``."""
    if timeout is not None:
        help_ = f"seconds per {per} (default {timeout:g})"
        ap.add_argument("--timeout", type=positive(float), default=timeout, help=help_)
    ap.add_argument("--json", type=Path, help="also write the results here")
    if extra:
        ap.add_argument("extra", nargs="*", help=extra)


def progress(line: str) -> None:
    """One progress line on stderr (stdout ends with the JSON line that callers parse)."""
    print(line, file=sys.stderr, flush=True)


def hard_exit(code: int) -> None:
    """Flush and leave without interpreter teardown, which engines with scheduler threads abort."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_bench(
    bench: Callable[[Any], Results], args: Any, report: Callable[[Results], str],
    summary: Callable[[Results], Results], report_to_stderr: bool = False,
) -> tuple[int, Results | None]:  # fmt: skip
    """Run ``bench(args)``, print the report, write ``--json``, print the JSON summary line last.
    Returns (2 on bad input, a ``ValueError``; 1 on a ``BenchError``: one line on stderr; else 0,
    and the results)."""
    try:
        out = bench(args)
    except (BenchError, ValueError) as e:  # ValueError: bad preset / checkpoint / backend / flag value
        print(f"error: {e}", file=sys.stderr)
        return (1 if isinstance(e, BenchError) else 2), None
    text = report(out)
    if text:
        print(text, file=sys.stderr if report_to_stderr else sys.stdout)
    if path := getattr(args, "json", None):  # written atomically
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=2, default=str))
        os.replace(tmp, path)
    print(json.dumps(summary(out), default=str), flush=True)
    return 0, out


def pick(d: Results, keys: Sequence[str]) -> Results:
    """The entries of ``d`` under ``keys`` that it has, in that order."""
    return {k: d[k] for k in keys if k in d}


def main_with_child(
    args: Any, child: Callable[[Any], Results] | None, bench: Callable[[Any], Results],
    report: Callable[[Results], str], summary: Callable[[Results], Results],
    strict: bool | Callable[[Results], bool] = False, report_to_stderr: bool = False,
) -> int:  # fmt: skip
    """A benchmark's ``main``: with ``--child`` print ``child(args)`` as one JSON line (a measurement
    in a fresh copy of itself), else ``run_bench``; ``strict`` (or ``strict(results)``): failed
    targets turn exit 0 into 1."""
    if getattr(args, "child", False):
        print(json.dumps(child(args)), flush=True)
        return 0
    code, out = run_bench(bench, args, report, summary, report_to_stderr)
    return exit_code(code, out, strict)


def failed_targets(out: Results) -> bool:
    """True when a target that applies failed (``pass`` is False; None = not applicable)."""
    return any(t.get("pass") is False for t in out.get("targets", {}).values())


def exit_code(code: int, out: Results | None, strict: bool | Callable[[Results], bool] = True) -> int:
    """``run_bench``'s code, turned into 1 when ``strict(out)``, or ``strict`` and a target that
    applies failed."""
    if code != 0 or out is None:
        return code
    return int(bool(strict(out) if callable(strict) else strict and failed_targets(out)))


def target(value: float | None, op: str, bound: float, applies: bool = True, why: str = "") -> Results:
    """A target check (``op``: <=, >= or ==): ``pass`` is None when it does not apply (e.g. a GPU
    target on CPU)."""
    ok = None
    if applies and value is not None:
        ok = {"<=": value <= bound, ">=": value >= bound, "==": value == bound}[op]
    shown = int(bound) if float(bound).is_integer() and abs(bound) >= 1000 else bound
    out: Results = {"value": value, "target": f"{op} {shown}", "pass": ok}
    if not applies and why:
        out["not_applicable"] = why
    return out


def positive(kind: type = int, least: float | None = None, why: str = "") -> Callable[[str], Any]:
    """argparse type: a number > 0, or >= ``least`` (``why``: the reason, in the error)."""

    def parse(s: str) -> Any:
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
        if v < least if least is not None else v <= 0:
            bound = f">= {least}" if least is not None else "> 0"
            raise argparse.ArgumentTypeError(f"must be {bound}{why}, got {s}")
        return v

    return parse


def csv_list(kind: type = str, least: int | None = None, what: str = "values") -> Callable[[str], list[Any]]:
    """argparse type: one or more comma-separated ``kind`` values, each >= ``least`` when given."""

    def parse(s: str) -> list[Any]:
        try:
            vals = [kind(x.strip()) for x in s.split(",") if x.strip()]
        except ValueError:
            vals = []
        if not vals:
            raise argparse.ArgumentTypeError(f"{s!r}: comma-separated {what} expected")
        if least is not None and min(vals) < least:
            raise argparse.ArgumentTypeError(f"{s!r}: every value must be >= {least}")
        return vals

    return parse


def csv_choice(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """argparse type: a comma-separated subset of ``choices``."""

    def parse(s: str) -> list[str]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        if not items or any(x not in choices for x in items):
            raise argparse.ArgumentTypeError(f"{s!r}: choose from {', '.join(choices)} (comma-separated)")
        return items

    return parse

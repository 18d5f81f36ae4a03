"""The test files that used the most CPU in the last suite run: ``python -m tests.junit_cpu
[XML ...] [--top N]`` sums the ``cpu_s`` property (``tests/conftest.py``) of each file's tests in
the JUnit XML files (default: ``.pytest_cache/junit-*.xml``, which ``scripts/run_tests.sh`` keeps)
and prints the total and the ``N`` largest files with their wall seconds beside."""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def split_classname(classname: str) -> tuple[str, list[str]] | None:
    """A JUnit ``classname`` (``tests.core.test_a.TestGroup``) as its test file and the classes in
    it (``tests/core/test_a.py``, ``["TestGroup"]``); None without a ``test_`` module."""
    parts = classname.split(".")
    mod = next((i for i, p in enumerate(parts) if p.startswith("test_")), None)
    return None if mod is None else ("/".join(parts[: mod + 1]) + ".py", parts[mod + 1 :])


def per_file(paths: list[Path]) -> dict[str, tuple[float, float, int]]:
    """``{test file: (CPU seconds, wall seconds, tests)}`` over ``paths``; a test without ``cpu_s``
    adds its wall seconds only."""
    out: dict[str, tuple[float, float, int]] = {}
    for xml in paths:
        for case in ET.parse(xml).iter("testcase"):
            split = split_classname(case.get("classname") or "")
            name = split[0] if split else case.get("classname") or "?"
            cpu = sum(float(p.get("value") or 0) for p in case.iter("property") if p.get("name") == "cpu_s")
            c, w, n = out.get(name, (0.0, 0.0, 0))
            out[name] = (c + cpu, w + float(case.get("time") or 0), n + 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.junit_cpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("xml", nargs="*", type=Path, help="JUnit XML files (default .pytest_cache/junit-*.xml)")
    ap.add_argument("--top", type=int, default=15, help="files to list (default 15)")
    args = ap.parse_args(argv)
    paths = args.xml or sorted((ROOT / ".pytest_cache").glob("junit-*.xml"))
    try:
        files = per_file(paths)
    except (ET.ParseError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cpu = sum(c for c, _, _ in files.values())
    print(f"[test] CPU seconds by test file: {cpu:.0f} in all ({', '.join(p.name for p in paths)})")
    for name, (c, w, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{c:8.1f} cpu-s {w:8.1f} s  {n:4d} tests  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

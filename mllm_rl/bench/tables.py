"""Plain-text tables for the benchmarks' human reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mllm_rl.text_table import aligned

VERDICT = {True: "pass", False: "FAIL", None: "n/a"}  # a target check's ``pass``, in words


def fmt(v: Any, spec: str = "") -> str:
    """One cell: ``-`` for None, ``yes``/``NO`` for booleans, numbers with ``spec``."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if spec and isinstance(v, (int, float)):
        return format(v, spec)
    return str(v)


def table(rows: Sequence[dict[str, Any]], cols: Sequence[tuple[str, str, str]]) -> str:
    """Plain-text table: ``cols`` = (key, header, format spec); the first column left-aligned."""
    cells = [[h for _, h, _ in cols]] + [[fmt(r.get(k), s) for k, _, s in cols] for r in rows]
    return "\n".join(aligned(cells, rule=True))


def merge_orders(orders: Sequence[Sequence[str]]) -> list[str]:
    """The names of several ordered lists in one order: a name only a later list has goes right
    after its predecessor there (phase orders of runs whose schedules differ)."""
    names: list[str] = []
    for order in orders:
        prev = None
        for n in order:
            if n not in names:
                names.insert(names.index(prev) + 1 if prev in names else len(names), n)
            prev = n
    return names


def target_lines(targets: dict[str, dict[str, Any]]) -> list[str]:
    """One line per target check (``cli.target``): value, bound, pass/FAIL/n/a and why not applicable."""
    return [
        f"target {name}: {t['value']} {t['target']} -> {VERDICT[t['pass']]}"
        + (f" ({t['not_applicable']})" if "not_applicable" in t else "")
        for name, t in targets.items()
    ]

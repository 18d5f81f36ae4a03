"""Plain-text tables for the benchmarks' human reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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
    widths = [max(len(c[i]) for c in cells) for i in range(len(cols))]
    lines = [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

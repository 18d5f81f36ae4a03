"""Plain-text tables: every table the project prints as text (run summaries, memory plans and their
audit, benchmark reports) is aligned here."""

from __future__ import annotations

from collections.abc import Sequence


def aligned(rows: Sequence[Sequence[str]], rule: bool = False, free_last: bool = False) -> list[str]:
    """``rows`` (the first: the header) as lines, columns two spaces apart, the first left-aligned.
    ``rule``: dashes under the header; ``free_last``: the last column is free text, not padded."""
    fixed = len(rows[0]) - 1 if free_last else len(rows[0])
    widths = [max(len(r[i]) for r in rows) for i in range(fixed)]
    lines = []
    for r in rows:
        cells = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r[:fixed], widths, strict=True))
        ]
        lines.append("  ".join(cells + list(r[fixed:])).rstrip())
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return lines

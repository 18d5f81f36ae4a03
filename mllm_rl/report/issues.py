"""A finding of the report's checks, with a severity that decides the CLI's exit status."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITIES = (ERROR, WARNING, INFO)


@dataclass
class Issue:
    """One finding. ``error``: the record set is wrong or incomplete (exit 1); ``warning``: suspicious;
    ``info``: a note (e.g. a step interrupted by a kill and completed by the resumed attempt)."""

    run: str
    kind: str
    message: str
    severity: str = ERROR
    process: int | None = None
    attempt: int | None = None  # 1-based; set only when the process has several attempts
    step: int | None = None
    phase: str | None = None

    def where(self) -> str:
        named = {"process": self.process, "attempt": self.attempt, "step": self.step}
        return " ".join(f"{k} {v}" for k, v in named.items() if v is not None)

    def line(self, where: str | None = None) -> str:
        """``severity: run where: message`` (``where``: ``self.where()``, or a group's from ``group_issues``)."""
        if where is None:
            where = self.where()
        return f"{self.severity}: {self.run}{' ' + where if where else ''}: {self.message}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "line": self.line()}


def count(issues: list[Issue]) -> dict[str, int]:
    return {s: sum(1 for i in issues if i.severity == s) for s in SEVERITIES}


def sort_issues(issues: list[Issue]) -> list[Issue]:
    """Errors first, then warnings, then notes; stable otherwise (recording order)."""
    return sorted(issues, key=lambda i: SEVERITIES.index(i.severity))


def int_ranges(values: list[int]) -> list[tuple[int, int]]:
    """Runs of consecutive ints, in the given order: ``[(0, 2), (5, 5)]`` for ``[0, 1, 2, 5]``."""
    out: list[tuple[int, int]] = []
    for v in values:
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


def _join(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _numbered(word: str, values: list[int]) -> str:
    """``steps 0-2, 5`` for ``[0, 1, 2, 5]``, ``process 3`` for ``[3]``, ``""`` for ``[]``."""
    if not values:
        return ""
    ranges = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in int_ranges(sorted(set(values))))
    plural = "es" if word.endswith("s") else "s"
    return f"{word}{plural if len(set(values)) > 1 else ''} {ranges}"


def group_issues(issues: list[Issue]) -> list[tuple[Issue, str]]:
    """Issues with the same severity, kind, phase and message folded into one line each:
    ``(first issue, where)`` with ``where`` like ``3x: processes 0-1 attempt 1 step 1``."""
    groups: dict[tuple[str, str, str | None, str, str], list[Issue]] = {}
    for i in sort_issues(issues):
        groups.setdefault((i.severity, i.kind, i.phase, i.run, i.message), []).append(i)
    out = []
    for first, *rest in groups.values():
        if not rest:
            out.append((first, first.where()))
            continue
        steps: dict[tuple[int | None, int | None], list[int]] = {}
        for m in (first, *rest):
            steps.setdefault((m.process, m.attempt), []).extend([] if m.step is None else [m.step])
        procs: dict[tuple[int | None, str], list[int]] = {}
        for (p, a), st in steps.items():
            text = _join(f"attempt {a}" if a is not None else "", _numbered("step", st))
            procs.setdefault((a, text), []).extend([] if p is None else [p])
        parts = [_join(_numbered("process", ps), text) for (_, text), ps in procs.items()]
        out.append((first, f"{len(rest) + 1}x: " + "; ".join(parts)))
    return out

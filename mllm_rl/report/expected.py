"""What a run should have recorded: processes, setup phases (once per attempt), phases per step, steps.

From ``run.json`` where it says (``process_count``, ``expected_phases``,
``expected_step_phases``, ``steps``, optional ``first_step``), else inferred from the records:
the union of what the processes recorded, in a merged order. Inference cannot see a phase
that is missing on every process; the report says which source it used.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from mllm_rl.report.load import Record, ReportInputError, Run

T = TypeVar("T", bound=Hashable)


@dataclass
class Expected:
    process_count: int
    phases: list[str]  # non-step phases, once per attempt
    step_phases: list[str]  # per step, with multiplicity (empty_cache twice)
    steps: list[int]
    source: str  # "run.json", "run.json+inferred" or "inferred"


def merge_orders(seqs: Iterable[list[T]]) -> list[T]:
    """One order holding every sequence's items (with multiplicity), longest sequence first; an
    extra occurrence goes after that sequence's previous name."""
    merged: list[T] = []
    for seq in sorted(seqs, key=len, reverse=True):
        pos = 0
        seen: Counter[T] = Counter()
        for name in seq:
            idxs = [i for i, n in enumerate(merged) if n == name]
            j = idxs[seen[name]] if seen[name] < len(idxs) else None
            seen[name] += 1
            if j is None:
                merged.insert(pos, name)
                pos += 1
            else:
                pos = max(pos, j + 1)
    return merged


def first_phase_guess(run: Run) -> str | None:
    """Without ``run.json``: the phase most processes began with."""
    firsts = Counter(recs[0]["phase"] for recs in run.records.values() if recs and recs[0]["step"] is None)
    return firsts.most_common(1)[0][0] if firsts else None


def _str_list(plan: dict[str, Any], key: str, where: str) -> list[str] | None:
    v = plan.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ReportInputError(f"{where}: {key} must be a list of phase names")
    return list(v)


def _int(plan: dict[str, Any], key: str, where: str) -> int | None:
    v = plan.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ReportInputError(f"{where}: {key} must be a non-negative integer")
    return v


def inferred(run: Run, attempts: dict[int, list[list[Record]]]) -> Expected:
    """Expected phases from the records alone (``attempts``: per process, records split per attempt)."""
    setup, per_step, steps = [], [], set()
    for per_proc in attempts.values():
        for recs in per_proc:
            setup.append([r["phase"] for r in recs if r["step"] is None])
            by_step: dict[int, list[str]] = {}
            for r in recs:
                if r["step"] is not None:
                    by_step.setdefault(r["step"], []).append(r["phase"])
            per_step += by_step.values()
            steps |= set(by_step)
    count = max(run.records) + 1 if run.records else 1
    step_range = list(range(min(steps), max(steps) + 1)) if steps else []
    return Expected(count, merge_orders(setup), merge_orders(per_step), step_range, "inferred")


def from_plan(run: Run, guess: Expected) -> Expected:
    """``run.json``'s expectations, each missing field filled from ``guess``."""
    if run.plan is None:
        return guess
    where = str(run.dir / "run.json")
    count = _int(run.plan, "process_count", where)
    phases = _str_list(run.plan, "expected_phases", where)
    step_phases = _str_list(run.plan, "expected_step_phases", where)
    n_steps = _int(run.plan, "steps", where)
    first = _int(run.plan, "first_step", where) or 0
    if n_steps and not step_phases:
        step_phases = None  # steps planned but their phases not listed: infer them
    filled = [count is None, phases is None, step_phases is None, n_steps is None]
    return Expected(
        process_count=guess.process_count if count is None else count,
        phases=guess.phases if phases is None else phases,
        step_phases=guess.step_phases if step_phases is None else step_phases,
        steps=guess.steps if n_steps is None else list(range(first, first + n_steps)),
        source="run.json+inferred" if any(filled) else "run.json",
    )

"""Read run directories (``phases.jsonl`` for process 0, ``phases.p<i>.jsonl`` for process i,
``run.json``) and split them into attempts (a resumed process) and tasks (a multi-task run).
Bad input raises a one-line ``ReportInputError`` naming the file and line; a torn last line is skipped."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mllm_rl.phases.schema import SchemaError, validate_record
from mllm_rl.report.issues import ERROR, WARNING, Issue

Record = dict[str, Any]
PHASE_FILE = re.compile(r"^phases(?:\.p(\d+))?\.jsonl$")


class ReportInputError(ValueError):
    """Bad input for the report (missing dir, no phase file, invalid record); the CLI exits 2."""


@dataclass
class Run:
    """One run directory: its records per process (recording order) and its ``run.json``, if any."""

    dir: Path
    label: str
    records: dict[int, list[Record]]
    plan: dict[str, Any] | None = None
    files: dict[int, Path] = field(default_factory=dict)
    torn_lines: list[str] = field(default_factory=list)
    origin_t0: float | None = None  # a task's part of a multi-task run keeps the run's time origin

    @property
    def run_id(self) -> str:
        if first := next((recs[0] for recs in self.records.values() if recs), None):
            return str(first["run_id"])
        planned = (self.plan or {}).get("run_id")
        return planned if isinstance(planned, str) else self.dir.name

    @property
    def backend(self) -> str:
        names = sorted({str(r["backend"]) for _, r in self.all_records()})
        if not names and self.plan and self.plan.get("backend"):
            return str(self.plan["backend"])
        return ",".join(names) or "-"

    @property
    def n_records(self) -> int:
        return sum(len(v) for v in self.records.values())

    @property
    def t0(self) -> float | None:
        """Earliest ``t_start`` of any process of this run (``None`` without records)."""
        if self.origin_t0 is not None:
            return self.origin_t0
        return min((r["t_start"] for _, r in self.all_records()), default=None)

    @property
    def t1(self) -> float | None:
        return max((r["t_end"] for _, r in self.all_records()), default=None)

    def all_records(self) -> Iterator[tuple[int, Record]]:
        for p in sorted(self.records):
            for r in self.records[p]:
                yield p, r


def is_number(v: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_record(rec: Any) -> None:
    """The schema check plus what the report relies on (numeric times, device objects)."""
    if not isinstance(rec, dict):
        raise SchemaError("expected a JSON object")
    validate_record(rec)
    if rec["process_index"] is None:
        raise SchemaError("process_index: null (the report needs the process)")
    if not (is_number(rec["t_start"]) and is_number(rec["t_end"])):
        raise SchemaError("t_start/t_end: expected numbers")
    for i, d in enumerate(rec["memory"]["devices"]):
        if not isinstance(d, dict):
            raise SchemaError(f"memory.devices[{i}]: expected an object")
        start = d.get("bytes_in_use_start")
        if start is not None and (not isinstance(start, int) or isinstance(start, bool) or start < 0):
            raise SchemaError(f"memory.devices[{i}].bytes_in_use_start: expected a non-negative int or null")


def read_phase_file(path: Path, process: int) -> tuple[list[Record], bool]:
    """Records of one process's file, and whether a torn last line was skipped."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ReportInputError(f"{path}: cannot read: {e}") from None
    out: list[Record] = []
    torn, last = False, max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == last:
                torn = True
                continue
            raise ReportInputError(f"{path}:{i + 1}: not JSON") from None
        try:
            _check_record(rec)
        except (SchemaError, TypeError, AttributeError, KeyError) as e:
            raise ReportInputError(f"{path}:{i + 1}: invalid phase record: {e}") from None
        if rec["process_index"] != process:
            raise ReportInputError(
                f"{path}:{i + 1}: record of process {rec['process_index']} in the file of process {process}"
            )
        out.append(rec)
    return out, torn


def _read_plan(path: Path) -> dict[str, Any] | None:
    try:
        plan = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportInputError(f"{path}: not valid JSON: {e}") from None
    if plan is not None and not isinstance(plan, dict):
        raise ReportInputError(f"{path}: expected a JSON object")
    return plan


def load_run(run_dir: str | Path, label: str | None = None) -> Run:
    """Load one run directory; raises ``ReportInputError`` naming the file (and line) on bad input."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportInputError(f"{run_dir}: no such run directory")
    files: dict[int, Path] = {}
    for f in run_dir.iterdir():
        m = PHASE_FILE.match(f.name)
        if m and f.is_file():
            files[int(m.group(1) or 0)] = f
    if not files:
        raise ReportInputError(f"{run_dir}: no phase file (phases.jsonl or phases.p<i>.jsonl)")
    read = {p: read_phase_file(files[p], p) for p in sorted(files)}
    records = {p: recs for p, (recs, _) in read.items()}
    torn = [files[p].name for p, (_, t) in read.items() if t]
    run = Run(
        run_dir, label or "", records, _read_plan(run_dir / "run.json"), dict(sorted(files.items())), torn
    )
    run.label = run.label or run.run_id
    return run


def load_runs(run_dirs: list[str | Path]) -> list[Run]:
    """Load several runs; labels are run ids, made unique with the directory name when they clash."""
    runs = [load_run(d) for d in run_dirs]
    counts = Counter(r.label for r in runs)
    for i, r in enumerate(runs):
        if counts[r.label] > 1:
            r.label = f"{r.label} [{i}:{r.dir.name}]"
    return runs


@dataclass
class Attempt:
    process: int
    number: int  # 1-based
    records: list[Record]
    is_last: bool

    def steps(self) -> list[int]:
        """Step numbers in order of first appearance."""
        return list(dict.fromkeys(r["step"] for r in self.records if r["step"] is not None))

    @property
    def shown(self) -> int | None:
        """The number tables and findings show: ``None`` when the process ran once."""
        return None if self.number == 1 and self.is_last else self.number

    def issue(self, run: str, kind: str, message: str, severity: str, **where: Any) -> Issue:
        """A finding about this attempt's process (and the attempt, when the process ran more than once)."""
        return Issue(run, kind, message, severity, process=self.process, attempt=self.shown, **where)

    @property
    def last_step(self) -> int | None:
        """The step of the last step record: where this attempt was when it ended."""
        return next((r["step"] for r in reversed(self.records) if r["step"] is not None), None)


def split_records(records: list[Record], first_phase: str | None) -> list[list[Record]]:
    """The records of one process, split at each attempt's start (``--resume`` appends to the same
    file): a non-step record of the run's first phase (e.g. ``wandb_init``), or ``idx`` 0 again."""
    parts: list[list[Record]] = []
    for r in records:
        starts = first_phase is not None and r["step"] is None and r["phase"] == first_phase
        restarted = bool(parts) and r["idx"] == 0  # a fresh recorder counts from 0
        if not parts or starts or restarted:
            parts.append([])
        parts[-1].append(r)
    return parts


def split_attempts(process: int, records: list[Record], first_phase: str | None) -> list[Attempt]:
    parts = split_records(records, first_phase)
    return [Attempt(process, i + 1, p, i == len(parts) - 1) for i, p in enumerate(parts)]


TASK_KEYS = ("expected_phases", "expected_step_phases", "steps", "first_step")


def _part(run: Run, task: str | None, plan: dict, label: str) -> Run:
    records = {p: [r for r in recs if r.get("task") == task] for p, recs in run.records.items()}
    torn = run.torn_lines if task is None else []
    return Run(run.dir, label, records, plan, run.files, torn, origin_t0=run.t0)


def split_tasks(run: Run) -> list[Run]:
    """``[run]``; for a multi-task run (``run.json`` has ``tasks``) its run-level part and one part per
    task (label ``<run> / <task>``, expectations from ``run.json["tasks"][task]``), on the run's clock."""
    tasks = (run.plan or {}).get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        return [run]
    base = {k: v for k, v in (run.plan or {}).items() if k != "tasks"}
    parts = [_part(run, None, base, run.label)]
    for name, t in tasks.items():
        t = t if isinstance(t, dict) else {}
        plan = {**base, **{k: t[k] for k in TASK_KEYS if k in t}, "task": name}
        plan |= {"task_status": t.get("status"), "task_error": t.get("error")}
        parts.append(_part(run, name, plan, f"{run.label} / {name}"))
    return parts


def task_issues(run: Run, parts: list[Run]) -> list[Issue]:
    """``task_failed`` per failed task, ``unknown_task`` for records of tasks run.json does not list."""
    plans = [(part.label, part.plan or {}) for part in parts[1:]]
    out = [
        Issue(label, "task_failed", f"task {plan['task']} failed: {plan.get('task_error')}"[:500], ERROR)
        for label, plan in plans
        if plan.get("task_status") == "failed"
    ]
    unknown = {r.get("task") for _, r in run.all_records()} - {plan.get("task") for _, plan in plans} - {None}
    msg = "records of task {!r}, which run.json does not list"
    return out + [Issue(run.label, "unknown_task", msg.format(t), WARNING) for t in sorted(map(str, unknown))]

"""The report's checks: what a run should have recorded (``run.json``, else the union of the
records), and every finding about what it did. docs/REPORT.md lists every kind."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from mllm_rl.phases.jsonsafe import is_non_finite, json_safe
from mllm_rl.report.issues import ERROR, INFO, WARNING, Issue, int_ranges
from mllm_rl.report.load import Attempt, Record, ReportInputError, Run

T = TypeVar("T", bound=Hashable)
MISSING, OUT_OF_ORDER = "missing_phase", "out_of_order"
DUPLICATE, UNEXPECTED = "duplicate_phase", "unexpected_phase"
# belongs to the failure it follows, not to the sequence (docs/MULTITASK.md)
FAULT_PHASES = ("release_on_fault",)
MIB = 2**20
FIRST_STEP = 1  # host growth is measured from here (step 0's compile caches stay)
MIN_STEPS = 4  # steps measured from FIRST_STEP on: three step-over-step rises
MIN_MIB_PER_STEP = 32


@dataclass
class Expected:
    process_count: int
    phases: list[str]  # non-step phases, once per attempt
    step_phases: list[str]  # per step, with multiplicity (empty_cache twice)
    steps: list[int]
    source: str  # "run.json", "run.json+inferred" or "inferred"


def merge_orders(seqs: Iterable[list[T]]) -> list[T]:
    """One order holding every sequence's items (with multiplicity), longest sequence first."""
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


def inferred(run: Run, attempts: dict[int, list[list[Record]]]) -> Expected:
    """Expected phases from the records alone (``attempts``: per process, records split per attempt)."""
    setup, per_step, steps = [], [], set()
    for recs in (recs for per_proc in attempts.values() for recs in per_proc):
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


def _plan_field(run: Run, key: str, names: bool) -> Any:
    """``run.json[key]``, ``None`` if absent: a list of phase names (``names``) or a non-negative int."""
    v = (run.plan or {}).get(key)
    if names:
        ok, what = isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of phase names"
    else:
        ok, what = isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a non-negative integer"
    if v is not None and not ok:
        raise ReportInputError(f"{run.dir / 'run.json'}: {key} must be {what}")
    return v


def from_plan(run: Run, guess: Expected) -> Expected:
    """``run.json``'s expectations, each missing field filled from ``guess``."""
    if run.plan is None:
        return guess
    count, n_steps = _plan_field(run, "process_count", False), _plan_field(run, "steps", False)
    phases = _plan_field(run, "expected_phases", True)
    step_phases = _plan_field(run, "expected_step_phases", True)
    first = _plan_field(run, "first_step", False) or 0
    if n_steps and not step_phases:
        step_phases = None  # steps planned but their phases not listed: infer them
    return Expected(
        process_count=guess.process_count if count is None else count,
        phases=guess.phases if phases is None else list(phases),
        step_phases=guess.step_phases if step_phases is None else list(step_phases),
        steps=guess.steps if n_steps is None else list(range(first, first + n_steps)),
        source="run.json+inferred" if None in (count, phases, step_phases, n_steps) else "run.json",
    )


@dataclass
class Finding:
    kind: str
    phase: str
    detail: str
    tail: bool = False  # missing: expected after everything recorded (the sequence stopped before it)
    pos: int = -1  # missing: position in the expected sequence
    count: int = 1  # missing: how many occurrences


def _lcs_pairs(a: list[str], b: list[str]) -> list[tuple[int, int]]:
    """Index pairs ``(i, j)`` of one longest common subsequence of ``a`` and ``b``."""
    n, m = len(a), len(b)
    dp = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            dp[i][j] = dp[i + 1][j + 1] + 1 if a[i] == b[j] else max(dp[i + 1][j], dp[i][j + 1])
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if a[i] == b[j]:
            pairs.append((i, j))
            i, j = i + 1, j + 1
        elif dp[i + 1][j] >= dp[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def _short(names: list[str], cap: int = 20) -> str:
    return ", ".join(names[:cap]) + (f", ... ({len(names) - cap} more)" if len(names) > cap else "")


def check_sequence(actual: list[str], expected: list[str]) -> list[Finding]:
    """Every difference between ``actual`` and ``expected``, aligned by a longest common subsequence
    (an unaligned phase found on both sides is out of order)."""
    pairs = _lcs_pairs(actual, expected)
    last = max((j for _, j in pairs), default=-1)  # furthest expected position recorded in order
    matched_a, matched_e = {i for i, _ in pairs}, {j for _, j in pairs}
    left_e = [j for j in range(len(expected)) if j not in matched_e]
    out: list[Finding] = []
    extra: Counter[str] = Counter()
    for i in (i for i in range(len(actual)) if i not in matched_a):
        j = next((j for j in left_e if expected[j] == actual[i]), None)
        if j is None:
            extra[actual[i]] += 1
            continue
        left_e.remove(j)
        detail = f"recorded [{_short(actual)}], expected [{_short(expected)}]"
        out.append(Finding(OUT_OF_ORDER, actual[i], detail))
    ce, ca = Counter(expected), Counter(actual)
    missing: dict[str, list[int]] = {}
    for j in left_e:
        missing.setdefault(expected[j], []).append(j)
    for name, pos in missing.items():  # one finding per name; its first missing occurrence decides "tail"
        detail = f"{len(pos)} of {ce[name]} missing" if ce[name] > 1 else ""
        out.append(Finding(MISSING, name, detail, tail=pos[0] > last, pos=pos[0], count=len(pos)))
    for name, n in extra.items():
        if name in ce:
            out.append(Finding(DUPLICATE, name, f"recorded {ca[name]} times, expected {ce[name]}"))
        else:
            out.append(Finding(UNEXPECTED, name, f"recorded {n} time(s)"))
    order = {MISSING: 0, OUT_OF_ORDER: 1, DUPLICATE: 2, UNEXPECTED: 3}
    out.sort(key=lambda f: (order[f.kind], f.pos))
    return out


def trailing_phases(exp: Expected, attempts: dict[int, list[Attempt]]) -> set[str]:
    """Non-step phases that come after the steps (e.g. ``generate_result``)."""
    out: set[str] = set()
    last_setup = -1
    last_index = {name: i for i, name in enumerate(exp.phases)}
    for a in (a for atts in attempts.values() for a in atts):
        has_steps, in_steps = a.last_step is not None, False
        for r in a.records:
            if r["step"] is not None:
                in_steps = True
            elif in_steps:
                out.add(r["phase"])
            elif has_steps and r["phase"] in last_index:
                last_setup = max(last_setup, last_index[r["phase"]])
    return out | (set(exp.phases[last_setup + 1 :]) if last_setup >= 0 else set())


FINDING_TEXT = {
    MISSING: (ERROR, "missing phase {phase}{paren}"),
    OUT_OF_ORDER: (ERROR, "phase {phase} out of order: {detail}"),
    DUPLICATE: (WARNING, "phase {phase} {detail}"),
    UNEXPECTED: (WARNING, "unexpected phase {phase} ({detail})"),
}


def _compare(
    label: str,
    a: Attempt,
    names: list[str],
    expected: list[str],
    step: int | None,
    stops: Callable[[Finding], bool],
) -> tuple[list[Issue], list[Finding]]:
    """Findings as issues; the missing ones where ``stops`` holds (the sequence stopped) apart."""
    issues, stopped = [], []
    for f in check_sequence(names, expected):
        if f.kind == MISSING and stops(f):
            stopped.append(f)
            continue
        sev, text = FINDING_TEXT[f.kind]
        msg = text.format(phase=f.phase, detail=f.detail, paren=f" ({f.detail})" if f.detail else "")
        issues.append(a.issue(label, f.kind, msg, sev, step=step, phase=f.phase))
    return issues, stopped


def _stopped(names: list[str], stopped: list[Finding]) -> str:
    """``stopped after <last phase>: missing a, b x2`` (``x2``: expected twice and missing twice)."""
    missing = ", ".join(f"{f.phase} x{f.count}" if f.count > 1 else f.phase for f in stopped)
    return f"stopped after {names[-1] if names else '(nothing)'}: missing {missing}"


def _check_setup(label: str, a: Attempt, exp: Expected, trailing: set[str]) -> list[Issue]:
    names = [r["phase"] for r in a.records if r["step"] is None and r["phase"] not in FAULT_PHASES]
    has_steps = a.last_step is not None
    issues, stopped = _compare(
        label, a, names, exp.phases, None, lambda f: f.tail and (not has_steps or f.phase in trailing)
    )
    if stopped:
        what = _stopped([f"step {a.last_step}"] if has_steps else names, stopped)
        if a.is_last:
            issues.append(a.issue(label, "incomplete", f"run {what}", ERROR, phase=stopped[0].phase))
        elif not has_steps:  # (an attempt that died in its steps gets its note from the step check)
            msg = f"attempt {what} (resumed by attempt {a.number + 1})"
            issues.append(a.issue(label, "interrupted", msg, INFO, phase=stopped[0].phase))
    return issues


def _restored(atts: list[Attempt], number: int, step: int) -> bool:
    """Did attempt ``number`` restore the checkpoint of ``step`` (``trainer_init``'s ``info.restored_from``)?"""
    name = f"step_{step:06d}"
    return any(
        r["phase"] == "trainer_init" and str(r["info"].get("restored_from") or "").rstrip("/").endswith(name)
        for r in atts[number - 1].records
    )


def _checkpointed(a: Attempt, step: int) -> bool:
    """Did ``a`` save a checkpoint of ``step`` (``info.saved``, or a later record's ``info.written``)?"""
    return any(
        (r["step"] == step and r["phase"] == "checkpoint" and r["info"].get("saved"))
        or any(isinstance(w, dict) and w.get("step") == step for w in r["info"].get("written") or ())
        for r in a.records
    )


def _stopped_step(label: str, atts: list[Attempt], a: Attempt, s: int, what: str, phase: str) -> Issue:
    """The step ``a`` stopped in: a note when a later attempt re-ran or resumed past it, else an error."""
    later = [b.number for b in atts if b.number > a.number and s in b.steps()]
    resumed_after = [b.number for b in atts if b.number > a.number and s + 1 in b.steps()]
    if not a.is_last and resumed_after and (_checkpointed(a, s) or _restored(atts, resumed_after[0], s)):
        sev, kind = INFO, "interrupted"  # killed after the step's checkpoint: the next attempt went on
        msg = f"interrupted after its checkpoint, {what}; attempt {resumed_after[0]} resumed from it"
    elif a.is_last:
        sev, kind, msg = ERROR, "incomplete_step", what
    elif later:
        sev, kind, msg = INFO, "interrupted", f"interrupted, {what}; re-run in attempt {later[0]}"
    else:
        sev, kind, msg = ERROR, "incomplete_step", f"interrupted and never re-run, {what}"
    return a.issue(label, kind, msg, sev, step=s, phase=phase)


def _check_steps(label: str, atts: list[Attempt], exp: Expected, plan_steps: bool) -> list[Issue]:
    p, issues = atts[0].process, []
    recorded = {s for a in atts for s in a.steps()}
    for lo, hi in int_ranges([s for s in exp.steps if s not in recorded]):
        what = f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
        msg = f"no record for {what} (expected steps {exp.steps[0]}-{exp.steps[-1]})"
        issues.append(Issue(label, "missing_step", msg, ERROR, process=p, step=lo))
    if plan_steps:
        for s in sorted(recorded - set(exp.steps)):
            msg = f"step {s} is not in the plan"
            issues.append(Issue(label, "unexpected_step", msg, WARNING, process=p, step=s))
    for a in atts:
        top: int | None = None
        for r in (r for r in a.records if r["step"] is not None):
            s = r["step"]
            if top is not None and s < top:
                msg = f"phase {r['phase']} of step {s} recorded after step {top}"
                issues.append(a.issue(label, "out_of_order", msg, ERROR, step=s, phase=r["phase"]))
            top = s if top is None else max(top, s)
        for s in a.steps():
            names = [r["phase"] for r in a.records if r["step"] == s and r["phase"] not in FAULT_PHASES]
            at_end = s == a.last_step
            found, stopped = _compare(label, a, names, exp.step_phases, s, lambda f, e=at_end: f.tail and e)
            issues += found
            if stopped:
                issues.append(_stopped_step(label, atts, a, s, _stopped(names, stopped), stopped[0].phase))
    return issues


def _ended(a: Attempt, ended: bool) -> tuple[str, str]:
    """Severity and note of a failed record: a note when it ended an attempt that a later one resumed."""
    return (INFO, f" (ended attempt {a.number}; resumed)") if ended else (ERROR, "")


def own_finding(r: Record) -> bool:
    """A failed record ``health_issues`` reports under its own kind (``info.stuck``/``non_finite``)."""
    return isinstance(r["info"].get("stuck"), dict) or bool(r["info"].get("non_finite"))


def _check_records(label: str, atts: list[Attempt]) -> list[Issue]:
    issues = []
    for a in atts:
        for i, r in enumerate(a.records):
            where = {"step": r["step"], "phase": r["phase"]}
            if (err := r["info"].get("error")) and not own_finding(r):
                ended = all(x["phase"] in FAULT_PHASES for x in a.records[i + 1 :]) and not a.is_last
                sev, note = _ended(a, ended)
                msg = f"phase {r['phase']} failed: {str(err)[:300]}{note}"
                issues.append(a.issue(label, "phase_error", msg, sev, **where))
            if n := r["info"].get("sample_errors"):
                msg = f"memory sampler failed {n} time(s) in phase {r['phase']}: its peak may be low"
                issues.append(a.issue(label, "sample_errors", msg, WARNING, **where))
    return issues


def completeness(run: Run, exp: Expected, attempts: dict[int, list[Attempt]]) -> list[Issue]:
    """Every process recorded every expected phase for every step, in order, judged per attempt."""
    label, issues = run.label, []
    if run.n_records == 0:
        names = ", ".join(f.name for f in run.files.values())
        issues.append(Issue(label, "no_records", f"no phase record in {names}"))
    for name in run.torn_lines:
        msg = f"{name}: torn last line skipped (writer killed mid-write)"
        issues.append(Issue(label, "torn_line", msg, WARNING))
    for p in range(exp.process_count):
        if not run.records.get(p) and run.n_records:
            why = f"{run.files[p].name} is empty" if p in run.files else "no phase file"
            msg = f"process {p} of {exp.process_count} recorded nothing ({why})"
            issues.append(Issue(label, "missing_process", msg, process=p))
    trailing = trailing_phases(exp, attempts)
    plan_steps = run.plan is not None and run.plan.get("steps") is not None
    for p, atts in ((p, atts) for p, atts in attempts.items() if atts):
        if p >= exp.process_count:
            msg = f"process {p} is beyond process_count {exp.process_count}"
            issues.append(Issue(label, "unexpected_process", msg, WARNING, process=p))
        if len(atts) > 1:
            starts = ", ".join(
                f"{a.number} at idx {a.records[0]['idx']}" + (f" (step {a.steps()[0]})" if a.steps() else "")
                for a in atts
            )
            msg = f"{len(atts)} attempts (resumed): {starts}"
            issues.append(Issue(label, "resumed", msg, INFO, process=p))
        for a in atts:
            issues += _check_setup(label, a, exp, trailing)
        issues += _check_steps(label, atts, exp, plan_steps) + _check_records(label, atts)
    return issues


def health_issues(label: str, attempts: dict[int, list[Attempt]]) -> list[Issue]:
    """``non_finite`` (a NaN/inf in a step record's ``info``) and ``stuck_phase`` (``info.stuck``);
    a note instead of an error when the record ended an attempt that a later one resumed."""
    issues = []
    for a in (a for atts in attempts.values() for a in atts):
        for i, r in enumerate(a.records):
            info, where = r["info"], {"step": r["step"], "phase": r["phase"]}
            sev, note = _ended(a, i == len(a.records) - 1 and not a.is_last)
            bad = [k for k, v in info.items() if is_non_finite(v)] if r["step"] is not None else []
            if bad:
                values = ", ".join(f"{k} {json_safe(info[k])}" for k in bad)
                msg = f"{r['phase']}: non-finite {values}{note}"
                issues.append(a.issue(label, "non_finite", msg, sev, **where))
            if isinstance(stuck := info.get("stuck"), dict):
                msg = (
                    f"phase {r['phase']} stuck: still running after its {stuck.get('limit_s')} s limit; "
                    f"every thread's stack in {stuck.get('stacks')}{note}"
                )
                issues.append(a.issue(label, "stuck_phase", msg, sev, **where))
    return issues


def step_rss(records: list[Record]) -> dict[int, int]:
    """Step -> host RSS bytes at the end of its last record (records in recording order)."""
    out: dict[int, int] = {}
    for r in records:
        step, host = r.get("step"), (r.get("memory") or {}).get("host") or {}
        if isinstance(step, int) and host.get("rss_bytes") is not None:
            out[step] = int(host["rss_bytes"])
    return out


def growth(rss: dict[int, int]) -> tuple[float, list[int]] | None:
    """(MiB per step, the steps) when ``rss`` (step -> bytes) rises in every step from ``FIRST_STEP``
    on (at least ``MIN_STEPS``), by more than ``MIN_MIB_PER_STEP`` on average and half that each time."""
    steps = sorted(s for s in rss if s >= FIRST_STEP)
    if len(steps) < MIN_STEPS:
        return None
    vals = [rss[s] for s in steps]
    per_step = (vals[-1] - vals[0]) / MIB / (steps[-1] - steps[0])
    rising = all(b - a > MIN_MIB_PER_STEP * MIB / 2 for a, b in zip(vals, vals[1:], strict=False))
    return (per_step, steps) if rising and per_step > MIN_MIB_PER_STEP else None


def host_growth(run: Run) -> list[Issue]:
    """A ``host_growth`` warning per process whose host RSS grows like a leak (``growth``)."""
    issues = []
    for proc, records in run.records.items():
        if (found := growth(rss := step_rss(records))) is None:
            continue
        per_step, steps = found
        a, b = steps[0], steps[-1]
        msg = (
            f"host RSS grew {per_step:.1f} MiB per step from step {a} to step {b} "
            f"({rss[a] / MIB:.1f} -> {rss[b] / MIB:.1f} MiB at the end of each step, rising in every one): "
            "host memory that is never freed, which ends a long run in the host's OOM killer"
        )
        issues.append(Issue(run.label, "host_growth", msg, severity=WARNING, process=proc))
    return issues

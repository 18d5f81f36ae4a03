"""Completeness: every process recorded every expected phase for every step, in order.

Judged per attempt (``attempts.py``); a missing trace point is never hidden. Errors:
``missing_phase`` (before, between, or in a step followed by others), ``incomplete`` /
``incomplete_step`` (a sequence that stopped in the last attempt; in an earlier one an
``interrupted`` note when a later attempt re-ran or resumed past it), ``missing_step``,
``missing_process``, ``phase_error`` (info when it ended a resumed attempt), ``out_of_order``.
Duplicates, unexpected records, sampler failures and torn lines are warnings.
``release_on_fault`` (docs/MULTITASK.md) belongs to the failure it follows, not to the sequence."""

from __future__ import annotations

from collections.abc import Callable

from mllm_rl.report.expected import Expected
from mllm_rl.report.health import own_finding
from mllm_rl.report.issues import ERROR, INFO, WARNING, Issue, int_ranges
from mllm_rl.report.load import Attempt, Run
from mllm_rl.report.sequence import DUPLICATE, MISSING, OUT_OF_ORDER, UNEXPECTED, Finding, check_sequence

Make = Callable[..., Issue]
FAULT_PHASES = ("release_on_fault",)


def trailing_phases(exp: Expected, attempts: dict[int, list[Attempt]]) -> set[str]:
    """Non-step phases that come after the steps (e.g. ``generate_result``): those recorded after a
    step anywhere, plus the expected ones after every setup phase recorded before a first step."""
    out: set[str] = set()
    last_setup = -1
    last_index = {name: i for i, name in enumerate(exp.phases)}
    for atts in attempts.values():
        for a in atts:
            has_steps, in_steps = a.last_step is not None, False
            for r in a.records:
                if r["step"] is not None:
                    in_steps = True
                elif in_steps:
                    out.add(r["phase"])
                elif has_steps and r["phase"] in last_index:
                    last_setup = max(last_setup, last_index[r["phase"]])
    if last_setup >= 0:
        out |= set(exp.phases[last_setup + 1 :])
    return out


def _bind(mk: Make, a: Attempt) -> Make:
    """``mk`` with the attempt filled in."""

    def bound(kind: str, msg: str, sev: str, **where: object) -> Issue:
        return mk(kind, msg, sev, a, **where)

    return bound


def _named(f: Finding) -> str:
    """``name`` or ``name x2`` (a phase expected twice in the sequence and missing twice)."""
    return f"{f.phase} x{f.count}" if f.count > 1 else f.phase


def _last_phase(names: list[str]) -> str:
    return names[-1] if names else "(nothing)"


def _other_findings(f: Finding, mk: Make, step: int | None) -> Issue | None:
    if f.kind == OUT_OF_ORDER:
        return mk(
            "out_of_order", f"phase {f.phase} out of order: {f.detail}", ERROR, step=step, phase=f.phase
        )
    if f.kind == DUPLICATE:
        return mk("duplicate_phase", f"phase {f.phase} {f.detail}", WARNING, step=step, phase=f.phase)
    if f.kind == UNEXPECTED:
        return mk(
            "unexpected_phase", f"unexpected phase {f.phase} ({f.detail})", WARNING, step=step, phase=f.phase
        )
    return None


def _missing(f: Finding, mk: Make, step: int | None) -> Issue:
    extra = f" ({f.detail})" if f.detail else ""
    return mk("missing_phase", f"missing phase {f.phase}{extra}", ERROR, step=step, phase=f.phase)


def _check_setup(a: Attempt, exp: Expected, trailing: set[str], mk: Make) -> list[Issue]:
    names = [r["phase"] for r in a.records if r["step"] is None and r["phase"] not in FAULT_PHASES]
    has_steps = any(r["step"] is not None for r in a.records)
    issues: list[Issue] = []
    stopped: list[Finding] = []
    for f in check_sequence(names, exp.phases):
        if f.kind == MISSING:
            if f.tail and (not has_steps or f.phase in trailing):
                stopped.append(f)
            else:
                issues.append(_missing(f, mk, None))
        elif (i := _other_findings(f, mk, None)) is not None:
            issues.append(i)
    if stopped:
        after = f"step {a.last_step}" if has_steps else _last_phase(names)
        what = f"stopped after {after}: missing {', '.join(_named(f) for f in stopped)}"
        if a.is_last:
            issues.append(mk("incomplete", f"run {what}", ERROR, phase=stopped[0].phase))
        elif not has_steps:  # (an attempt that died in its steps gets its note from the step check)
            issues.append(
                mk(
                    "interrupted",
                    f"attempt {what} (resumed by attempt {a.number + 1})",
                    INFO,
                    phase=stopped[0].phase,
                )
            )
    return issues


def _check_steps(atts: list[Attempt], exp: Expected, plan_steps: bool, mk: Make) -> list[Issue]:
    issues: list[Issue] = []
    recorded = {s for a in atts for s in a.steps()}
    for lo, hi in int_ranges([s for s in exp.steps if s not in recorded]):
        what = f"step {lo}" if lo == hi else f"steps {lo}-{hi}"
        issues.append(
            mk(
                "missing_step",
                f"no record for {what} (expected steps {exp.steps[0]}-{exp.steps[-1]})",
                ERROR,
                step=lo,
            )
        )
    if plan_steps:
        for s in sorted(recorded - set(exp.steps)):
            issues.append(mk("unexpected_step", f"step {s} is not in the plan", WARNING, step=s))
    for a in atts:
        mka = _bind(mk, a)
        top: int | None = None
        for r in a.records:
            s = r["step"]
            if s is None:
                continue
            if top is not None and s < top:
                issues.append(
                    mka(
                        "out_of_order",
                        f"phase {r['phase']} of step {s} recorded after step {top}",
                        ERROR,
                        step=s,
                        phase=r["phase"],
                    )
                )
            top = s if top is None else max(top, s)
        for s in a.steps():
            names = [r["phase"] for r in a.records if r["step"] == s and r["phase"] not in FAULT_PHASES]
            later = [b.number for b in atts if b.number > a.number and s in b.steps()]
            stopped: list[Finding] = []
            for f in check_sequence(names, exp.step_phases):
                if f.kind == MISSING:
                    if f.tail and s == a.last_step:
                        stopped.append(f)
                    else:
                        issues.append(_missing(f, mka, s))
                elif (i := _other_findings(f, mka, s)) is not None:
                    issues.append(i)
            if not stopped:
                continue
            what = f"stopped after {_last_phase(names)}: missing {', '.join(_named(f) for f in stopped)}"
            resumed_after = [b.number for b in atts if b.number > a.number and s + 1 in b.steps()]
            if (
                not a.is_last
                and resumed_after
                and (_checkpointed(a, s) or _restored(atts, resumed_after[0], s))
            ):
                # killed after the step's checkpoint: the next attempt restored it and went on
                issues.append(
                    mka(
                        "interrupted",
                        f"interrupted after its checkpoint, {what}; attempt "
                        f"{resumed_after[0]} resumed from it",
                        INFO,
                        step=s,
                        phase=stopped[0].phase,
                    )
                )
                continue
            if a.is_last:
                issues.append(mka("incomplete_step", what, ERROR, step=s, phase=stopped[0].phase))
            elif later:
                issues.append(
                    mka(
                        "interrupted",
                        f"interrupted, {what}; re-run in attempt {later[0]}",
                        INFO,
                        step=s,
                        phase=stopped[0].phase,
                    )
                )
            else:
                issues.append(
                    mka(
                        "incomplete_step",
                        f"interrupted and never re-run, {what}",
                        ERROR,
                        step=s,
                        phase=stopped[0].phase,
                    )
                )
    return issues


def _restored(atts: list[Attempt], number: int, step: int) -> bool:
    """Did attempt ``number`` restore the checkpoint of ``step`` (``trainer_init``'s
    ``info.restored_from``)? A checkpoint written in the background may have ended after the
    last record of the attempt that began it."""
    name = f"step_{step:06d}"
    return any(
        r["phase"] == "trainer_init" and str(r["info"].get("restored_from") or "").rstrip("/").endswith(name)
        for b in atts
        if b.number == number
        for r in b.records
    )


def _checkpointed(a: Attempt, step: int) -> bool:
    """Did ``a`` save a checkpoint of ``step``: its ``checkpoint`` phase with ``info.saved``, or a
    background write of it recorded as ended (in a later record's ``info.written``)?"""
    return any(
        (r["step"] == step and r["phase"] == "checkpoint" and r["info"].get("saved"))
        or any(isinstance(w, dict) and w.get("step") == step for w in r["info"].get("written") or ())
        for r in a.records
    )


def _check_records(atts: list[Attempt], mk: Make) -> list[Issue]:
    issues = []
    for a in atts:
        for i, r in enumerate(a.records):
            err = r["info"].get("error")
            if err and not own_finding(r):  # non_finite / stuck_phase: health.py reports those
                rest = a.records[i + 1 :]
                ended = all(x["phase"] in FAULT_PHASES for x in rest) and not a.is_last
                sev, note = (INFO, f" (ended attempt {a.number}; resumed)") if ended else (ERROR, "")
                issues.append(
                    mk(
                        "phase_error",
                        f"phase {r['phase']} failed: {str(err)[:300]}{note}",
                        sev,
                        a,
                        step=r["step"],
                        phase=r["phase"],
                    )
                )
            n = r["info"].get("sample_errors")
            if n:
                issues.append(
                    mk(
                        "sample_errors",
                        f"memory sampler failed {n} time(s) in phase {r['phase']}: its peak may be low",
                        WARNING,
                        a,
                        step=r["step"],
                        phase=r["phase"],
                    )
                )
    return issues


def completeness(run: Run, exp: Expected, attempts: dict[int, list[Attempt]]) -> list[Issue]:
    """Every finding about what ``run`` recorded versus ``exp`` (see the module doc)."""
    issues: list[Issue] = []
    if run.n_records == 0:
        names = ", ".join(f.name for f in run.files.values())
        issues.append(Issue(run.label, "no_records", f"no phase record in {names}"))
    for name in run.torn_lines:
        issues.append(
            Issue(
                run.label, "torn_line", f"{name}: torn last line skipped (writer killed mid-write)", WARNING
            )
        )
    for p in range(exp.process_count):
        if not run.records.get(p) and run.n_records:
            why = f"{run.files[p].name} is empty" if p in run.files else "no phase file"
            issues.append(
                Issue(
                    run.label,
                    "missing_process",
                    f"process {p} of {exp.process_count} recorded nothing ({why})",
                    process=p,
                )
            )
    trailing = trailing_phases(exp, attempts)
    plan_steps = run.plan is not None and run.plan.get("steps") is not None
    for p, atts in attempts.items():
        if not atts:
            continue
        multi = len(atts) > 1

        def mk(
            kind: str,
            msg: str,
            sev: str,
            a: Attempt | None = None,
            p: int = p,
            multi: bool = multi,
            **where: object,
        ) -> Issue:
            attempt = a.number if a is not None and multi else None
            return Issue(run.label, kind, msg, sev, process=p, attempt=attempt, **where)  # type: ignore[arg-type]

        if p >= exp.process_count:
            issues.append(
                mk("unexpected_process", f"process {p} is beyond process_count {exp.process_count}", WARNING)
            )
        if multi:
            starts = ", ".join(
                f"{a.number} at idx {a.records[0]['idx']}" + (f" (step {a.steps()[0]})" if a.steps() else "")
                for a in atts
            )
            issues.append(mk("resumed", f"{len(atts)} attempts (resumed): {starts}", INFO))
        for a in atts:
            issues += _check_setup(a, exp, trailing, _bind(mk, a))
        issues += _check_steps(atts, exp, plan_steps, mk)
        issues += _check_records(atts, mk)
    return issues

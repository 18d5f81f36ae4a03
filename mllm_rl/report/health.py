"""Findings about what a run computed and how its phases ended, beyond completeness.

``non_finite`` (error): a NaN/inf number in a step record's ``info`` (``mllm_rl.run`` already stops
at one in ``train_step``, exit 5; this finds any phase's from the records alone). ``stuck_phase``
(error): a phase ran past its watchdog limit (``info.stuck``; exit 6). Both replace the generic
``phase_error`` of the same record (``completeness.own_finding``)."""

from __future__ import annotations

from typing import Any

from mllm_rl.phases.jsonsafe import is_non_finite, json_safe
from mllm_rl.report.issues import ERROR, INFO, Issue
from mllm_rl.report.load import Attempt


def non_finite_keys(info: dict[str, Any]) -> list[str]:
    """Top-level ``info`` keys whose value is NaN/inf (or its name, as strict JSON writes it)."""
    return [k for k, v in info.items() if is_non_finite(v)]


def own_finding(r: dict[str, Any]) -> bool:
    """A failed record that ``health_issues`` reports under its own kind instead of ``phase_error``:
    the run's own stops (``info.stuck`` from the watchdog, ``info.non_finite`` from the lifecycle)."""
    info = r["info"]
    return isinstance(info.get("stuck"), dict) or bool(info.get("non_finite"))


def health_issues(label: str, attempts: dict[int, list[Attempt]]) -> list[Issue]:
    """``non_finite`` and ``stuck_phase`` findings; a note (info) instead of an error when the record
    ended an attempt that a later one resumed, as for ``phase_error``."""
    issues = []
    for p, atts in attempts.items():
        multi = len(atts) > 1
        for a in atts:
            where = {"process": p, "attempt": a.number if multi else None}
            for i, r in enumerate(a.records):
                info = r["info"]
                ended = i == len(a.records) - 1 and not a.is_last
                sev, note = (INFO, f" (ended attempt {a.number}; resumed)") if ended else (ERROR, "")
                bad = non_finite_keys(info) if r["step"] is not None else []
                if bad:
                    values = ", ".join(f"{k} {json_safe(info[k])}" for k in bad)
                    issues.append(
                        Issue(
                            label,
                            "non_finite",
                            f"{r['phase']}: non-finite {values}{note}",
                            sev,
                            step=r["step"],
                            phase=r["phase"],
                            **where,
                        )
                    )
                stuck = info.get("stuck")
                if isinstance(stuck, dict):
                    issues.append(
                        Issue(
                            label,
                            "stuck_phase",
                            f"phase {r['phase']} stuck: still running after its {stuck.get('limit_s')} s limit; "
                            f"every thread's stack in {stuck.get('stacks')}{note}",
                            sev,
                            step=r["step"],
                            phase=r["phase"],
                            **where,
                        )
                    )
    return issues

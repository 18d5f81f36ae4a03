"""Several runs side by side (jax vs torch, multi-stage vs naive): same phase, memory and time.

Phases are matched by ``(step, name, occurrence in that step)``, so the second ``empty_cache``
of step 3 meets the second ``empty_cache`` of step 3. Per run and phase: seconds is the
slowest process; memory is summed over every device of every process (most truthful source),
``None`` as soon as one process lacks the phase or a value. A resumed run counts its last
attempt's record of a phase.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from mllm_rl.report.attempts import Attempt
from mllm_rl.report.expected import merge_orders
from mllm_rl.report.load import Record
from mllm_rl.report.memory import device_sum, total

PhaseKey = tuple[int | None, str, int]


def key_label(key: PhaseKey) -> str:
    step, name, k = key
    s = name + (f"#{k + 1}" if k else "")
    return s if step is None else f"{s} @{step}"


def keyed_records(atts: list[Attempt]) -> dict[PhaseKey, Record]:
    """Per process: each record under its key, keys in order of first appearance; a later
    attempt's record replaces an earlier one's values (not its place)."""
    out: dict[PhaseKey, Record] = {}
    for a in atts:
        seen: Counter[tuple[int | None, str]] = Counter()
        for r in a.records:
            k = (r["step"], r["phase"])
            out[(r["step"], r["phase"], seen[k])] = r
            seen[k] += 1
    return out


def run_phase_values(
    attempts: dict[int, list[Attempt]],
) -> tuple[list[PhaseKey], dict[PhaseKey, dict[str, Any]]]:
    """A run's phase keys in order and, per key, ``seconds`` / ``after_bytes`` / ``peak_bytes``."""
    per_proc = [keyed_records(atts) for atts in attempts.values() if atts]
    keys = merge_orders([list(d) for d in per_proc])
    values = {}
    for k in keys:
        recs = [d.get(k) for d in per_proc]
        present = [r for r in recs if r is not None]
        values[k] = {
            "seconds": max(r["t_end"] - r["t_start"] for r in present),
            "after_bytes": total(None if r is None else device_sum(r, "bytes_in_use") for r in recs),
            "peak_bytes": total(None if r is None else device_sum(r, "phase_peak_bytes") for r in recs),
            "processes": len(present),
        }
    return keys, values


def compare_rows(per_run: list[dict[int, list[Attempt]]]) -> list[dict[str, Any]]:
    """``[{"phase": label, "step": s, "name": n, "runs": [values or None per run]}]``, merged phase order."""
    keyed = [run_phase_values(atts) for atts in per_run]
    label_of = {key_label(k): k for keys, _ in keyed for k in keys}
    order = merge_orders([[key_label(k) for k in keys] for keys, _ in keyed])
    rows = []
    for lab in order:
        k = label_of[lab]
        rows.append(
            {"phase": lab, "step": k[0], "name": k[1], "runs": [values.get(k) for _, values in keyed]}
        )
    return rows

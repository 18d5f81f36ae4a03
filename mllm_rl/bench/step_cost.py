"""Where the time of a colocated RL step goes, from a run's phase records.

A step is the records with one ``step``; its wall time runs from its first record's start to its
last's end, and the gaps (snapshots, sink writes) are ``between_phases``. A repeated phase name is
kept apart (``empty_cache#2``). Counted steps are complete, error-free and not an attempt's first
(it compiles). Per phase: medians over counted steps of seconds and of step share (shares need
not sum to 1), and the bytes it moved (``info`` ``bytes``/``expected_*_bytes``) with their rate."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from typing import Any

ROLLOUT, TRAIN, CHECKPOINT = "rollout", "train_step", "checkpoint"
BETWEEN = "between_phases"
BYTE_FIELDS = ("bytes", "expected_alloc_bytes", "expected_freed_bytes")


@dataclasses.dataclass
class Step:
    """One step's records, reduced to times (seconds) and ``info`` per phase key."""

    step: int
    attempt: int
    first_of_attempt: bool
    wall_s: float
    seconds: dict[str, float]  # phase key -> seconds, in order
    info: dict[str, dict[str, Any]]
    error: str | None = None

    @property
    def between_s(self) -> float:
        return max(0.0, self.wall_s - sum(self.seconds.values()))


def split_steps(records: Sequence[dict[str, Any]]) -> list[Step]:
    """The steps of ``records`` (one process's phase log, in order), each attempt's apart."""
    attempt, stepped_before = 0, False
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("step") is None:
            if stepped_before:  # setup records after steps: a resumed attempt (or the final eval)
                attempt += 1
            stepped_before = False
            continue
        groups.setdefault((attempt, int(r["step"])), []).append(r)
        stepped_before = True
    first = {}
    for a, s in groups:
        first[a] = min(first.get(a, s), s)
    steps = []
    for (a, s), recs in groups.items():
        seconds: dict[str, float] = {}
        info: dict[str, dict[str, Any]] = {}
        error = None
        for r in recs:
            name, k = r["phase"], 2
            key = name
            while key in seconds:
                key, k = f"{name}#{k}", k + 1
            seconds[key] = float(r["t_end"]) - float(r["t_start"])
            info[key] = r.get("info") or {}
            error = error or info[key].get("error")
        wall = float(recs[-1]["t_end"]) - float(recs[0]["t_start"])
        steps.append(Step(s, a, s == first[a], wall, seconds, info, error))
    return steps


def counted(steps: Sequence[Step], expected: Sequence[str] | None = None) -> list[Step]:
    """The steps that count (see the module docstring). ``expected``: the phase names of one step
    (``run.json``'s ``expected_step_phases``); without it, the phase set most steps have."""
    keys = [_keys(expected)] if expected else [tuple(s.seconds) for s in steps]
    want = max(set(keys), key=keys.count) if keys else ()
    return [s for s in steps if not s.first_of_attempt and s.error is None and tuple(s.seconds) == want]


def _keys(names: Sequence[str]) -> tuple[str, ...]:
    out: list[str] = []
    for n in names:
        key, k = n, 2
        while key in out:
            key, k = f"{n}#{k}", k + 1
        out.append(key)
    return tuple(out)


def moved_bytes(info: dict[str, Any]) -> int | None:
    """The bytes a phase moved, as its record says (None when it says nothing)."""
    for f in BYTE_FIELDS:
        v = info.get(f)
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _median(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def other_share_at_cadence(use: Sequence[Step], every: int) -> float | None:
    """Median over ``use`` of the non-rollout, non-train share with each save's ``checkpoint``
    seconds spread over ``every`` steps. ``None`` when no step saved, or a save was written in the
    background (its cost overlaps other phases; measure the cadence and read ``other_share_total``)."""
    if any(s.info.get(CHECKPOINT, {}).get("background") for s in use):
        return None
    shares = []
    for s in use:
        if not s.info.get(CHECKPOINT, {}).get("path"):  # no save begun (in the phase or in the background)
            continue
        ck = s.seconds[CHECKPOINT]
        wall = s.wall_s - ck + ck / every
        shares.append((wall - s.seconds.get(ROLLOUT, 0.0) - s.seconds.get(TRAIN, 0.0)) / wall)
    return round(statistics.median(shares), 6) if shares else None


def analyse(
    records: Sequence[dict[str, Any]], expected: Sequence[str] | None = None, cadence: int | None = None
) -> dict[str, Any]:
    """Per-phase medians over the counted steps; ``ValueError`` when no step counts. ``cadence``:
    also the share with a checkpoint every ``cadence`` steps (``other_share_at_cadence``)."""
    steps = split_steps(records)
    use = counted(steps, expected)
    if not use:
        raise ValueError(
            f"no complete step after the first of its run ({len(steps)} step(s) recorded): "
            "the first step compiles and is left out, so run --steps >= 2"
        )
    keys = list(use[0].seconds)
    phases = []
    for k in keys:
        secs = [s.seconds[k] for s in use]
        nbytes = _median([moved_bytes(s.info[k]) for s in use])
        med = statistics.median(secs)
        phases.append(
            {
                "phase": k,
                "seconds_median": round(med, 6),
                "share_median": round(statistics.median(s.seconds[k] / s.wall_s for s in use), 6),
                "bytes_median": int(nbytes) if nbytes is not None else None,
                "gbps_median": round(nbytes / med / 1e9, 4) if nbytes and med > 0 else None,
            }
        )
    phases.append(
        {
            "phase": BETWEEN,
            "seconds_median": round(statistics.median(s.between_s for s in use), 6),
            "share_median": round(statistics.median(s.between_s / s.wall_s for s in use), 6),
            "bytes_median": None,
            "gbps_median": None,
        }
    )
    other = [(s.wall_s - s.seconds.get(ROLLOUT, 0.0) - s.seconds.get(TRAIN, 0.0)) / s.wall_s for s in use]
    first = [s for s in steps if s.first_of_attempt and s.attempt == 0]
    step_med = statistics.median(s.wall_s for s in use)
    return {
        "steps_recorded": len(steps),
        "steps_counted": [s.step for s in use],
        "step_s_median": round(step_med, 6),
        "first_step_s": round(first[0].wall_s, 6) if first else None,
        "first_over_median": round(first[0].wall_s / step_med, 3) if first and step_med > 0 else None,
        "other_share_median": round(statistics.median(other), 6),
        # time-weighted over the counted steps: the share of the whole run's step time
        "other_share_total": round(
            sum(o * s.wall_s for o, s in zip(other, use, strict=True)) / sum(s.wall_s for s in use), 6
        ),
        "checkpoints_background": sum(bool(s.info.get(CHECKPOINT, {}).get("background")) for s in use),
        "other_s_median": round(statistics.median(o * s.wall_s for o, s in zip(other, use, strict=True)), 6),
        "cadence": cadence,
        "other_share_at_cadence": other_share_at_cadence(use, cadence) if cadence else None,
        "phases": phases,
        "update": _update_detail(use),
        "checkpoints_saved": sum(bool(s.info.get(CHECKPOINT, {}).get("path")) for s in use),
    }


def _update_detail(use: Sequence[Step]) -> dict[str, Any] | None:
    """``update_weights``: the engine's install (``info.seconds``) vs the rest (export, fingerprints)."""
    recs = [
        (s.seconds["update_weights"], s.info["update_weights"]) for s in use if "update_weights" in s.seconds
    ]
    if not recs:
        return None
    around = [1 - i["seconds"] / t for t, i in recs if isinstance(i.get("seconds"), (int, float)) and t > 0]
    return {
        "full_updates": sum(bool(i.get("full")) for _, i in recs),
        "updates": len(recs),
        "tensors": recs[0][1].get("tensors"),
        "install_s_median": _median([i.get("seconds") for _, i in recs]),
        "phase_s_median": round(statistics.median(t for t, _ in recs), 6),
        "around_install_share_median": round(statistics.median(around), 4) if around else None,
    }

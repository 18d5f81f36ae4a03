"""Did releases free what they should, and how high did the param swap peak?

``efficiency_rows``: per release/offload phase, bytes freed on the devices (start minus end, by the
most truthful source) vs ``info.expected_freed_bytes``, flagged below ``EFFICIENCY_MIN`` or at
zero; resume/onload phases get unflagged rows (a resume may alias arrays and allocate nothing).
``swap_ratios``: ``phase_peak / steady`` of each weight-swap phase, per device; the run's figure is
the max over devices (as ``python -m mllm_rl.bench swap``)."""

from __future__ import annotations

from typing import Any

from mllm_rl.report.attempts import Attempt
from mllm_rl.report.load import Record
from mllm_rl.report.memory import device_name, devices_of_source, diff, primary_devices, sources, total
from mllm_rl.report.tables import row_id

EFFICIENCY_MIN = 0.95
FREE_PREFIXES = ("release", "offload")
ALLOC_PREFIXES = ("resume", "onload")
SWAP_PHASES = ("weights_swapped", "update_weights")


def _bytes_info(v: Any) -> int | None:
    """An ``info`` byte count: an int, or a dict of ints (per tag) summed; anything else unknown."""
    if isinstance(v, dict):
        return total(_bytes_info(x) for x in v.values())
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    return None


def row_kind(rec: Record) -> str | None:
    """``free`` / ``alloc`` / ``None``: whether this phase gets an efficiency row."""
    name, info = rec["phase"], rec["info"]
    if "expected_freed_bytes" in info or name.startswith(FREE_PREFIXES):
        return "free"
    if "expected_alloc_bytes" in info or name.startswith(ALLOC_PREFIXES):
        return "alloc"
    return None


def _ratio(num: int | None, den: int | None) -> float | None:
    return num / den if num is not None and den else None


def _moved(devs: list[dict[str, Any]], kind: str) -> int | None:
    """Bytes freed (``free``) or allocated (``alloc``) over the phase, summed; ``None`` if unknown."""
    sign = 1 if kind == "free" else -1
    return total(
        None if (d := diff(x.get("bytes_in_use_start"), x.get("bytes_in_use"))) is None else sign * d
        for x in devs
    )


def efficiency_row(run_label: str, a: Attempt, rec: Record, multi: bool) -> dict[str, Any] | None:
    kind = row_kind(rec)
    if kind is None:
        return None
    devices = rec["memory"]["devices"]
    prim = primary_devices(devices)
    actual = _moved(prim, kind)
    by_source = {s: _moved(devices_of_source(devices, s), kind) for s in sources(devices)}
    key = "expected_freed_bytes" if kind == "free" else "expected_alloc_bytes"
    expected = _bytes_info(rec["info"].get(key))
    ratio = _ratio(actual, expected)
    flagged, note = False, ""
    if actual is None:
        note = "device bytes not measurable" if prim else "no device recorded"
    elif kind == "free":
        if expected == 0:
            note = "nothing to free"
        elif actual <= 0:
            flagged, note = True, "freed nothing"
        elif ratio is not None and ratio < EFFICIENCY_MIN:
            flagged, note = (
                True,
                f"freed {ratio:.1%} of what the released objects hold (< {EFFICIENCY_MIN:.0%})",
            )
        elif expected is None:
            note = "no expected_freed_bytes"
    return {
        "process": a.process,
        "attempt": a.number if multi else None,
        "step": rec["step"],
        "phase": rec["phase"],
        "idx": rec["idx"],
        "kind": kind,
        "source": prim[0].get("source") if prim else None,
        "actual_bytes": actual,
        "expected_bytes": expected,
        "ratio": ratio,
        "by_source": by_source,
        "flagged": flagged,
        "note": note,
        "run": run_label,
        "devices": [
            {
                "device": device_name(d),
                "source": d.get("source"),
                "start": d.get("bytes_in_use_start"),
                "end": d.get("bytes_in_use"),
            }
            for d in devices
        ],
    }


def efficiency_rows(run_label: str, attempts: dict[int, list[Attempt]]) -> list[dict[str, Any]]:
    rows = []
    for atts in attempts.values():
        for a in atts:
            for rec in a.records:
                row = efficiency_row(run_label, a, rec, len(atts) > 1)
                if row is not None:
                    rows.append(row)
    return rows


def swap_ratios(run_label: str, attempts: dict[int, list[Attempt]]) -> list[dict[str, Any]]:
    """One row per weight-swap phase record: peak/steady per device and the max over devices."""
    rows = []
    for atts in attempts.values():
        for a in atts:
            tp = next((r["info"].get("tp") for r in a.records if isinstance(r["info"].get("tp"), int)), 1)
            for r in a.records:
                if r["phase"] not in SWAP_PHASES:
                    continue
                devs = primary_devices(r["memory"]["devices"])
                per_dev = [
                    {
                        "device": device_name(d),
                        "source": d.get("source"),
                        "peak": d.get("phase_peak_bytes"),
                        "steady": d.get("bytes_in_use"),
                        "ratio": _ratio(d.get("phase_peak_bytes"), d.get("bytes_in_use")),
                    }
                    for d in devs
                ]
                ratios = [d["ratio"] for d in per_dev if d["ratio"] is not None]
                weights = _bytes_info(r["info"].get("bytes"))
                per_dev_w = weights / len(devs) if weights and tp > 1 and devs else weights
                w_ratios = [
                    (d["peak"] - (d["steady"] - per_dev_w)) / per_dev_w
                    for d in per_dev
                    if d["peak"] is not None and d["steady"] is not None and per_dev_w
                ]
                rows.append(
                    {
                        **row_id(run_label, a, len(atts), r),
                        "peak_max": max((d["peak"] for d in per_dev if d["peak"] is not None), default=None),
                        "steady_max": max(
                            (d["steady"] for d in per_dev if d["steady"] is not None), default=None
                        ),
                        "ratio": max(ratios) if ratios and len(ratios) == len(per_dev) else None,
                        "weights_only_ratio": max(w_ratios)
                        if w_ratios and len(w_ratios) == len(per_dev)
                        else None,
                        "weight_bytes": weights,
                        "devices": per_dev,
                    }
                )
    return rows

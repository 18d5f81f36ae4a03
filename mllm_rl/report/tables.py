"""Rows of the report's tables (report.html, summary.json, W&B): per phase record, release/offload,
weight swap, RL metric and compared phase. Device bytes: sums over one entry per device (the most
truthful source); ``None`` is unknown, never 0."""

from __future__ import annotations

from collections import Counter
from typing import Any

from mllm_rl.report.checks import merge_orders
from mllm_rl.report.load import Attempt, Record, Run, is_number
from mllm_rl.report.memory import device_name, device_sum, diff, primary_devices, sources, total

PHASE_COLUMNS = tuple(
    "run process attempt step phase idx seconds t_offset_s before_bytes after_bytes peak_bytes delta_bytes "
    "host_rss_bytes host_rss_peak_bytes source error".split()
)
EFFICIENCY_MIN = 0.95
FREE_PREFIXES, ALLOC_PREFIXES = ("release", "offload"), ("resume", "onload")
SWAP_PHASES = ("weights_swapped", "update_weights")
SKIP_KEYS = {"sample_errors", "tp", "process_index", "process_count", "idx"}  # bookkeeping, not metrics
PREFERRED = tuple(
    "reward_mean loss reward kl entropy grad_norm advantage clip completion_len response_len lr".split()
)
MAX_SERIES = 12
SECONDARY_KEYS = {"before": "bytes_in_use_start", "after": "bytes_in_use", "peak": "phase_peak_bytes"}


def row_id(run_label: str, a: Attempt, r: Record) -> dict[str, Any]:
    """The columns that name a record (attempt: None when the process ran once)."""
    ids = {"run": run_label, "process": a.process, "attempt": a.shown}
    return ids | {k: r[k] for k in ("step", "phase", "idx")}


def phase_rows(run_label: str, attempts: dict[int, list[Attempt]], t0: float | None) -> list[dict[str, Any]]:
    """One row per record; ``secondary`` holds the same sums per other source present (CUDA:
    ``torch_allocator`` next to ``mem_get_info``)."""
    rows = []
    for atts in attempts.values():
        for a in atts:
            for r in a.records:
                devs, host = r["memory"]["devices"], r["memory"]["host"]
                source = "+".join(sorted({str(d.get("source")) for d in primary_devices(devs)}))
                before, after = device_sum(r, "bytes_in_use_start"), device_sum(r, "bytes_in_use")
                secondary = {
                    s: {k: device_sum(r, key, s) for k, key in SECONDARY_KEYS.items()}
                    for s in sources(devs)[1:]
                }
                rows.append(
                    {
                        **row_id(run_label, a, r),
                        "seconds": r["t_end"] - r["t_start"],
                        "t_offset_s": None if t0 is None else r["t_start"] - t0,
                        "before_bytes": before,
                        "after_bytes": after,
                        "peak_bytes": device_sum(r, "phase_peak_bytes"),
                        "delta_bytes": diff(after, before),
                        "host_rss_bytes": host.get("rss_bytes"),
                        "host_rss_peak_bytes": host.get("rss_peak_bytes"),
                        "source": source or None,
                        "error": str(r["info"]["error"]) if r["info"].get("error") else None,
                        "secondary": secondary,
                    }
                )
    return rows


def _bytes_info(v: Any) -> int | None:
    """An ``info`` byte count: an int, or a dict of ints (per tag) summed; anything else unknown."""
    if isinstance(v, dict):
        return total(_bytes_info(x) for x in v.values())
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def row_kind(rec: Record) -> str | None:
    """``free`` (a release/offload), ``alloc`` (a resume/onload) or ``None`` (no efficiency row)."""
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
    moved = (diff(x.get("bytes_in_use_start"), x.get("bytes_in_use")) for x in devs)
    return total(None if d is None else sign * d for d in moved)


def efficiency_row(run_label: str, a: Attempt, rec: Record) -> dict[str, Any] | None:
    """Bytes a release/offload freed vs ``info.expected_freed_bytes``, flagged below ``EFFICIENCY_MIN``
    or at zero; a resume/onload's allocated bytes, never flagged (it may alias arrays)."""
    kind = row_kind(rec)
    if kind is None:
        return None
    devices = rec["memory"]["devices"]
    prim = primary_devices(devices)
    actual = _moved(prim, kind)
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
            flagged = True
            note = f"freed {ratio:.1%} of what the released objects hold (< {EFFICIENCY_MIN:.0%})"
        elif expected is None:
            note = "no expected_freed_bytes"
    return {
        **row_id(run_label, a, rec),
        "kind": kind,
        "source": prim[0].get("source") if prim else None,
        "actual_bytes": actual,
        "expected_bytes": expected,
        "ratio": ratio,
        "by_source": {
            s: _moved([d for d in devices if d.get("source") == s], kind) for s in sources(devices)
        },
        "flagged": flagged,
        "note": note,
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
    rows = (efficiency_row(run_label, a, r) for atts in attempts.values() for a in atts for r in a.records)
    return [r for r in rows if r is not None]


def _max_of_all(values: list[float], n: int) -> float | None:
    """The max of ``values`` when there is one for each of ``n`` devices, else unknown."""
    return max(values) if values and len(values) == n else None


def swap_ratios(run_label: str, attempts: dict[int, list[Attempt]]) -> list[dict[str, Any]]:
    """Per weight-swap record: ``phase_peak / steady`` per device and the max (as ``mllm_rl.bench swap``)."""
    rows = []
    for atts in attempts.values():
        for a in atts:
            tp = next((r["info"].get("tp") for r in a.records if isinstance(r["info"].get("tp"), int)), 1)
            for r in (r for r in a.records if r["phase"] in SWAP_PHASES):
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
                peaks, steadies = ([d[k] for d in per_dev if d[k] is not None] for k in ("peak", "steady"))
                weights = _bytes_info(r["info"].get("bytes"))
                w = weights / len(devs) if weights and tp > 1 and devs else weights  # per device
                w_ratios = [
                    (d["peak"] - (d["steady"] - w)) / w
                    for d in per_dev
                    if d["peak"] is not None and d["steady"] is not None and w
                ]
                rows.append(
                    {
                        **row_id(run_label, a, r),
                        "peak_max": max(peaks, default=None),
                        "steady_max": max(steadies, default=None),
                        "ratio": _max_of_all(ratios, len(per_dev)),
                        "weights_only_ratio": _max_of_all(w_ratios, len(per_dev)),
                        "weight_bytes": weights,
                        "devices": per_dev,
                    }
                )
    return rows


def _rank(name: str, values: dict[int, float]) -> tuple[int, bool, str]:
    """Preferred keys first, then series that change, then constant ones; by name within."""
    key = name.split(".", 1)[1]
    pref = next((i for i, p in enumerate(PREFERRED) if key.startswith(p)), len(PREFERRED))
    return pref, len(set(values.values())) <= 1, name


def step_metrics(run: Run, limit: int = MAX_SERIES) -> list[dict[str, Any]]:
    """``[{"name": "<phase>.<key>", "points": [[step, value], ...]}]``: the lowest process's finite
    numeric step ``info`` values but byte counts and ``SKIP_KEYS`` (a re-run step: its last value)."""
    if not run.records:
        return []
    series: dict[str, dict[int, float]] = {}
    for r in run.records[min(run.records)]:
        if r["step"] is None:
            continue
        for k, v in r["info"].items():
            if k not in SKIP_KEYS and not k.endswith("_bytes") and is_number(v):
                series.setdefault(f"{r['phase']}.{k}", {})[r["step"]] = float(v)
    names = sorted(series, key=lambda n: _rank(n, series[n]))[:limit]
    return [{"name": n, "points": [[s, series[n][s]] for s in sorted(series[n])]} for n in names]


PhaseKey = tuple[int | None, str, int]  # (step, phase, occurrence in that step)


def key_label(key: PhaseKey) -> str:
    step, name, k = key
    s = name + (f"#{k + 1}" if k else "")
    return s if step is None else f"{s} @{step}"


def keyed_records(atts: list[Attempt]) -> dict[PhaseKey, Record]:
    """Per process: each record under its key (first-appearance order; a later attempt's values win)."""
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
    """A run's phase keys in order and per key ``seconds`` (slowest process), ``after_bytes`` and
    ``peak_bytes`` (summed over every process; ``None`` as soon as one lacks it)."""
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
    """Several runs side by side: ``[{"phase", "step", "name", "runs": [values or None per run]}]``;
    phases match by ``(step, name, occurrence in that step)``."""
    keyed = [run_phase_values(atts) for atts in per_run]
    label_of = {key_label(k): k for keys, _ in keyed for k in keys}
    order = merge_orders([[key_label(k) for k in keys] for keys, _ in keyed])
    pairs = [(lab, label_of[lab]) for lab in order]
    return [
        {"phase": lab, "step": k[0], "name": k[1], "runs": [values.get(k) for _, values in keyed]}
        for lab, k in pairs
    ]

"""A run held against its memory plan: predicted (``plan.json``) vs measured (``phases.jsonl``) bytes.

``compare``: the components' byte counts the records give, and per phase end (setup's, the last
step's) the fullest device's ``bytes_in_use`` against what the plan keeps resident; a step's phase
holds if it held in either of the last two steps (an array released a step late is no leak).
``drifts``: phases above the plan by more than the tolerance and a MiB."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mllm_rl.memplan.compose import SETUP_PREFIX, unit_for
from mllm_rl.memplan.residency import end_state
from mllm_rl.text_table import aligned

COMPARED = ("engine_weights", "kv_pool", "trainer_params", "optimizer")
TRAINER_STATE = ("trainer_params", "optimizer")
TOLERANCE = 0.05
NOISE_BYTES = 2**20  # below this a measured figure is bookkeeping (scalars), not a component
MIB = 2**20


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "phases.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise ValueError(f"{path}: not found (not a run directory?)") from None


def _per_device(rec: dict[str, Any], value: Callable[[dict[str, Any]], Any]) -> dict[Any, int]:
    """``value`` of each device of the record (the first entry of a device id is its truth)."""
    seen: dict[Any, int] = {}
    for d in rec.get("memory", {}).get("devices") or []:
        if d["id"] not in seen and (v := value(d)) is not None:
            seen[d["id"]] = int(v)
    return seen


def _device_bytes(rec: dict[str, Any]) -> int | None:
    """The bytes in use on the fullest device; torch's allocator less its ``paused_bytes`` (an
    in-process engine's paused regions: the driver's figure adds the context and cached blocks)."""
    per = _per_device(rec, lambda d: d.get("bytes_in_use"))
    for d in rec.get("memory", {}).get("devices") or []:
        paused = (d.get("raw") or {}).get("paused_bytes")
        if d.get("source") == "torch_allocator" and paused is not None and d.get("bytes_in_use") is not None:
            per[d["id"]] = int(d["bytes_in_use"]) - int(paused)
    return max(per.values(), default=None)


def _pinned_host_bytes(rec: dict[str, Any]) -> int | None:
    """Bytes of ``pinned_host`` arrays the JAX probe saw (None: a probe that does not count them)."""
    seen = _per_device(rec, lambda d: (d.get("raw") or {}).get("pinned_host_bytes"))
    return sum(seen.values()) if seen else None


def measured_components(records: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    devices = 1
    for r in records:
        info = r.get("info", {})
        if r["phase"] == "release_rollout" and "held" in info and "engine_weights" not in out:
            out["engine_weights"] = int(info["held"].get("weights", 0))
            out["kv_pool"] = int(info["held"].get("kv_cache", 0))
        if r["phase"] == "trainer_init" and "state_bytes" in info:
            out["trainer_params"] = int(info["state_bytes"]["params"])
            out["optimizer"] = int(info["state_bytes"]["optimizer"])
            devices = max(1, len(_per_device(r, lambda d: d.get("bytes_in_use"))))
    # the engine's and the trainer's counts are over every device: one device's even share
    out = {k: v // devices for k, v in out.items()}
    missing = [c for c in COMPARED if c not in out]
    if missing:
        raise ValueError(
            f"phase records lack {', '.join(missing)} (need release_rollout held, trainer_init state_bytes)"
        )
    return out


def _ratio(pred: int, meas: int | None) -> float | None:
    return None if meas is None or meas < NOISE_BYTES else pred / meas


def _within(pred: int, meas: int, tolerance: float) -> bool:
    return abs(pred - meas) <= max(tolerance * meas, NOISE_BYTES if meas < NOISE_BYTES else 0)


def _above(measured: int | None, predicted: int, tolerance: float) -> bool:
    return measured is not None and measured > predicted * (1 + tolerance) + NOISE_BYTES


def _phase_ends(
    records: list[dict[str, Any]], plan_phases: list[dict[str, Any]], step: int | None, tolerance: float
) -> dict[str, dict[str, Any]]:
    """Rows by phase name (setup's prefixed) of setup and ``step``: the bytes the plan keeps
    resident at each phase's end against the record's."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if step is not None and r.get("step") == step:
            by_name.setdefault(r["phase"], []).append(r)
        elif r.get("step") is None:
            by_name.setdefault(SETUP_PREFIX + r["phase"], []).append(r)
    rows: dict[str, dict[str, Any]] = {}
    seen: dict[str, int] = {}
    for p in plan_phases:
        name = p["phase"]
        i = seen.get(name, 0)
        seen[name] = i + 1
        recs = by_name.get(name, [])
        if i >= len(recs) or (got := _device_bytes(recs[i])) is None:
            continue
        ends = end_state(name.removeprefix(SETUP_PREFIX), tuple(p["resident"]))
        pred = sum(p["resident"][c] for c in ends)
        rows[name if i == 0 else f"{name}#{i + 1}"] = {
            "phase": name,
            "resident_at_end": list(ends),
            "predicted": pred,
            "measured": got,
            "ratio": _ratio(pred, got),
            "within": _within(pred, got, tolerance),
            "predicted_during": int(p["total"]),
            "below_during": got <= p["total"] * (1 + tolerance),
            # host: the trainer's offloaded state (residency.host_rows) and what the probe saw (JAX pinned_host)
            "host_trainer_predicted": sum(v for c, v in p.get("host_end", {}).items() if c in TRAINER_STATE),
            "host_trainer_measured": _pinned_host_bytes(recs[i]),
        }
    return rows


def compare(
    records: list[dict[str, Any]], plan_doc: dict[str, Any], tolerance: float = TOLERANCE
) -> dict[str, Any]:
    """Components and phase ends, predicted vs measured, with ``within`` flags (``ValueError`` or
    ``KeyError`` when they cannot be compared)."""
    plan = plan_doc["plans"][plan_doc["schedule"]]
    comps = {  # on the devices: a host-resident component (Component.memory) holds none there
        k: int(v["bytes_per_device"]) if v.get("memory", "device") == "device" else 0
        for k, v in plan["components"].items()
    }
    meas = measured_components(records)
    comp_rows = [
        {
            "component": c,
            "predicted": comps.get(c, 0),
            "measured": meas[c],
            "ratio": _ratio(comps.get(c, 0), meas[c]),
            "within": _within(comps.get(c, 0), meas[c], tolerance),
        }
        for c in COMPARED
    ]
    steps = sorted({r["step"] for r in records if r.get("step") is not None})
    last = _phase_ends(records, plan["phases"], steps[-1] if steps else None, tolerance)
    before = _phase_ends(records, plan["phases"], steps[-2], tolerance) if len(steps) > 1 else {}
    phase_rows = []
    for key, row in last.items():
        prev = None if key.startswith(SETUP_PREFIX) else before.get(key)
        row["measured_before"] = None if prev is None else prev["measured"]
        row["within_last"] = row["within"]
        row["within"] = row["within"] or (prev is not None and prev["within"])
        phase_rows.append(row)
    grad = plan["functions"].get("grad_step", {})
    rss = [
        {"step": r["step"], "rss_rise": int(h["rss_peak_bytes"]) - int(h["rss_start_bytes"])}
        for r in records
        if r["phase"] == "train_step" and "rss_peak_bytes" in (h := r["memory"].get("host", {}))
    ]
    return {
        "tolerance": tolerance,
        "components": comp_rows,
        "phases": phase_rows,
        "grad_step": {
            "temp_bytes": grad.get("temp_bytes"),
            "peak_bytes": grad.get("peak_bytes"),
            "extra_bytes": grad.get("extra_bytes"),
            "measured_rss_rise": rss,
        },
        "within": all(r["within"] for r in comp_rows) and all(r["within"] for r in phase_rows),
    }


def drifts(check: dict[str, Any]) -> list[dict[str, Any]]:
    """Phases whose end bytes exceed the prediction by more than the tolerance (in both last steps)."""
    tol = check["tolerance"]
    return [
        r
        for r in check["phases"]
        if _above(r["measured"], r["predicted"], tol)
        and (r.get("measured_before") is None or _above(r["measured_before"], r["predicted"], tol))
    ]


def summary(check: dict[str, Any]) -> str:
    """One line: how many phases held to the plan."""
    n, bad = len(check["phases"]), drifts(check)
    if not bad:
        return f"memory plan: {n} of {n} phases ended within {check['tolerance']:.0%} of the prediction or below it"
    worst = max(bad, key=lambda r: r["measured"] - r["predicted"])
    return (
        f"memory plan: {len(bad)} of {n} phases ended above the prediction by more than "
        f"{check['tolerance']:.0%}; worst {worst['phase']}: {worst['measured'] / MIB:.1f} MiB in use, "
        f"{worst['predicted'] / MIB:.1f} MiB predicted"
    )


def table(check: dict[str, Any]) -> str:
    """Predicted vs measured bytes at every phase end, the step before's, and whether it drifts."""
    rows = check["phases"]
    unit, scale = unit_for(max([1, *(max(r["predicted"], r["measured"] or 0) for r in rows)]))
    drifting = {id(r) for r in drifts(check)}
    cells = [["phase", f"predicted {unit}", f"measured {unit}", "step before", "ratio",
              f"within {check['tolerance']:.0%}"]]  # fmt: skip
    for r in rows:
        before = "-" if r.get("measured_before") is None else f"{r['measured_before'] / scale:.2f}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        verdict = "DRIFT" if id(r) in drifting else ("yes" if r["within"] else "below")
        cells.append([r["phase"], f"{r['predicted'] / scale:.2f}", f"{(r['measured'] or 0) / scale:.2f}", before,
                      ratio, verdict])  # fmt: skip
    title = (
        "Memory plan vs run (bytes in use at each phase's end; PREDICTED by the plan, MEASURED by the run):"
    )
    return "\n".join([title, *aligned(cells, rule=True, free_last=True)])


def check_run_dir(run_dir: Path, records: list[dict[str, Any]]) -> tuple[dict[str, Any] | None, str | None]:
    """``compare`` with ``run_dir/plan.json``: ``(check, None)``, ``(None, why not)``, ``(None, None)``: no plan."""
    path = run_dir / "plan.json"
    if not path.is_file():
        return None, None
    try:
        doc = json.loads(path.read_text())
        check = compare(records, doc)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{path} not compared with the records: {e}"
    check["target"] = doc.get("plans", {}).get(doc.get("schedule"), {}).get("target", {}).get("name")
    return check, None


def drift_messages(check: dict[str, Any]) -> list[str]:
    """One warning per drifting phase, for the report's findings."""
    return [
        f"{r['phase']}: {r['measured'] / MIB:.1f} MiB in use at its end, the plan predicted "
        f"{r['predicted'] / MIB:.1f} MiB ({', '.join(r['resident_at_end']) or 'nothing'} resident): memory "
        f"the plan does not know of (a leak if it grows step by step)"
        for r in drifts(check)
    ]

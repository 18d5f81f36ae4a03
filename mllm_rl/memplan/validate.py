"""Hold a plan against a run: predicted (``plan.json``) vs measured (``phases.jsonl``) bytes.

Used by ``scripts/bench_plan_cpu.py`` and its test: a plan made for the run's own devices (the
``cpu`` target, same code) must predict what the run's phase records measured.

Measured, per component, from the records' ``info`` (the engine's and trainer's own byte counts
of their arrays): ``engine_weights`` and ``kv_pool`` = ``held`` of the first ``release_rollout``;
``trainer_params`` and ``optimizer`` = ``state_bytes`` of ``trainer_init``. Per phase: the device
truth's ``bytes_in_use`` at the end of each phase of the last step (and of setup), against the
plan's components still resident when the phase ends (``residency.end_state``), and under the
plan's total during the phase (``predicted_during``, its peak with the compiled temporaries).
A step's phase holds when it held in the last step or the one before (``measured_before``). A run
over several devices (a TPU slice) is compared by its fullest device at each phase end, and its
components by one device's even share of the engine's and trainer's counts (the plan is per device).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mllm_rl.memplan.compose import SETUP_PREFIX
from mllm_rl.memplan.residency import end_state

COMPARED = ("engine_weights", "kv_pool", "trainer_params", "optimizer")


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "phases.jsonl"
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except FileNotFoundError:
        raise ValueError(f"{path}: not found (not a run directory?)") from None


def _per_device(rec: dict[str, Any]) -> dict[Any, int]:
    seen: dict[Any, int] = {}
    for d in rec.get("memory", {}).get("devices") or []:  # the first entry of each device id is its truth
        if d["id"] not in seen and d.get("bytes_in_use") is not None:
            seen[d["id"]] = int(d["bytes_in_use"])
    return seen


def _device_bytes(rec: dict[str, Any]) -> int | None:
    """The bytes in use on the fullest device (a plan is one device's share; on a mesh every device
    should hold about the same)."""
    return max(_per_device(rec).values(), default=None)


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
            devices = max(1, len(_per_device(r)))
    # the engine's and the trainer's counts are over every device: one device's even share
    out = {k: v // devices for k, v in out.items()}
    missing = [c for c in COMPARED if c not in out]
    if missing:
        raise ValueError(
            f"phase records lack {', '.join(missing)} (need release_rollout held, trainer_init state_bytes)"
        )
    return out


NOISE_BYTES = 2**20  # below this a measured figure is bookkeeping (scalars), not a component


def _ratio(pred: int, meas: int | None) -> float | None:
    return None if meas is None or meas < NOISE_BYTES else pred / meas


def _within(pred: int, meas: int, tolerance: float) -> bool:
    return abs(pred - meas) <= max(tolerance * meas, NOISE_BYTES if meas < NOISE_BYTES else 0)


def _phase_ends(
    records: list[dict[str, Any]], plan_phases: list[dict[str, Any]], step: int | None, tolerance: float
) -> dict[str, dict[str, Any]]:
    """Rows (by phase name, setup phases prefixed) of one step's phases and of setup: the bytes
    the plan says stay resident at each phase's end against the record's device truth."""
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
        if i >= len(recs):
            continue
        ends = end_state(name.removeprefix(SETUP_PREFIX), tuple(p["resident"]))
        pred = sum(p["resident"][c] for c in ends)
        got = _device_bytes(recs[i])
        if got is None:
            continue
        key = name if i == 0 else f"{name}#{i + 1}"
        rows[key] = {
            "phase": name,
            "resident_at_end": list(ends),
            "predicted": pred,
            "measured": got,
            "ratio": _ratio(pred, got),
            "within": _within(pred, got, tolerance),
            "predicted_during": int(p["total"]),
            "below_during": got <= p["total"] * (1 + tolerance),
            # the trainer's offloaded state on the host at the phase's end (residency.host_rows), and
            # what the probe saw there where it can (JAX: arrays of the pinned_host memory kind)
            "host_trainer_predicted": sum(v for c, v in p.get("host_end", {}).items() if c in TRAINER_STATE),
            "host_trainer_measured": _pinned_host_bytes(recs[i]),
        }
    return rows


TRAINER_STATE = ("trainer_params", "optimizer")


def _pinned_host_bytes(rec: dict[str, Any]) -> int | None:
    """Bytes of ``pinned_host`` arrays the JAX probe saw (None: a probe that does not count them)."""
    seen: dict[Any, int] = {}
    for d in rec.get("memory", {}).get("devices") or []:
        b = (d.get("raw") or {}).get("pinned_host_bytes")
        if b is not None and d["id"] not in seen:
            seen[d["id"]] = int(b)
    return sum(seen.values()) if seen else None


def compare(
    records: list[dict[str, Any]], plan_doc: dict[str, Any], tolerance: float = 0.05
) -> dict[str, Any]:
    """Components and per-phase end-of-phase bytes, predicted vs measured, with ``within`` flags."""
    plan = plan_doc["plans"][plan_doc["schedule"]]
    comps = {  # on the devices: a host-resident component (Component.memory) holds none there
        k: int(v["bytes_per_device"]) if v.get("memory", "device") == "device" else 0
        for k, v in plan["components"].items()
    }
    meas = measured_components(records)
    comp_rows = []
    for c in COMPARED:
        pred = comps.get(c, 0)
        comp_rows.append(
            {
                "component": c,
                "predicted": pred,
                "measured": meas[c],
                "ratio": _ratio(pred, meas[c]),
                "within": _within(pred, meas[c], tolerance),
            }
        )
    steps = sorted({r["step"] for r in records if r.get("step") is not None})
    last = _phase_ends(records, plan["phases"], steps[-1] if steps else None, tolerance)
    before = _phase_ends(records, plan["phases"], steps[-2], tolerance) if len(steps) > 1 else {}
    phase_rows = []
    for key, row in last.items():
        prev = None if key.startswith(SETUP_PREFIX) else before.get(key)
        row["measured_before"] = None if prev is None else prev["measured"]
        row["within_last"] = row["within"]
        # a step's phase holds when it held in one of the last two steps: an array that one step
        # released late (a scheduler thread's transient, a reference cycle) is not memory the plan misses
        row["within"] = row["within"] or (prev is not None and prev["within"])
        phase_rows.append(row)
    grad = plan["functions"].get("grad_step", {})
    rss = []
    for r in records:
        h = r["memory"].get("host", {})
        if r["phase"] == "train_step" and "rss_peak_bytes" in h:
            rss.append({"step": r["step"], "rss_rise": int(h["rss_peak_bytes"]) - int(h["rss_start_bytes"])})
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

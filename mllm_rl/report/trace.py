"""Perfetto / Chrome trace JSON (``trace.json``) of every process's phase file: per run and rank,
thread ``phases`` (an ``X`` event per record) and ``steps`` (a span per step), ``C`` memory counters
and an ``i`` instant where a phase failed (docs/REPORT.md)."""

from __future__ import annotations

from typing import Any

from mllm_rl.phases.jsonsafe import dumps
from mllm_rl.report.load import Attempt, Record
from mllm_rl.report.memory import TRUTH, device_name, primary_devices

PHASES_TID, STEPS_TID = 1, 2
MAX_STR = 200


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def _cut(text: str) -> str:
    return text if len(text) <= MAX_STR else text[:MAX_STR] + "..."


def summarize(v: Any) -> Any:
    """A short, JSON-safe version of an ``info`` value for trace args."""
    if v is None or isinstance(v, (bool, int, float)):
        return v
    if isinstance(v, str):
        return _cut(v)
    if isinstance(v, (list, tuple)):
        if len(v) <= 8 and all(isinstance(x, (bool, int, float, str)) for x in v):
            return [summarize(x) for x in v]
        return f"[{len(v)} items]"
    return _cut(dumps(v))


def counter_name(d: dict[str, Any]) -> str:
    if d.get("source") == TRUTH:
        return f"device truth {device_name(d)} ({TRUTH})"
    return f"mem {device_name(d)} ({d.get('source')})"


def _pick(d: dict[str, Any], **keys: str) -> dict[str, Any]:
    return {k: d.get(v) for k, v in keys.items()}


def _slice(
    name: str, cat: str, pid: int, tid: int, ts: float, te: float, args: dict[str, Any]
) -> dict[str, Any]:
    """An ``X`` event from ``ts`` to ``te`` (µs)."""
    ev = {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts}
    return ev | {"dur": max(0.0, round(te - ts, 3)), "args": args}


def _counters(pid: int, name: str, points: list[tuple[float, Any]]) -> list[dict[str, Any]]:
    """``C`` events of ``name`` at each ``(ts, bytes)``; an unknown value adds no point."""
    return [
        {"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": ts, "args": {"bytes": v}}
        for ts, v in points
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]


def _record_events(r: Record, pid: int, t0: float, attempt: int | None) -> list[dict[str, Any]]:
    ts, te = _us(r["t_start"], t0), _us(r["t_end"], t0)
    devs, host = r["memory"]["devices"], r["memory"]["host"]
    memory = {
        f"{device_name(d)} ({d.get('source')})": _pick(
            d, before="bytes_in_use_start", after="bytes_in_use", peak="phase_peak_bytes", limit="bytes_limit"
        )
        for d in devs
    }
    memory["host rss"] = _pick(host, before="rss_start_bytes", after="rss_bytes", peak="rss_peak_bytes")
    info = {k: summarize(v) for k, v in r["info"].items()}
    args = {"step": r["step"], "idx": r["idx"], "attempt": attempt, "info": info, "memory": memory}
    ev = [_slice(r["phase"], "phase", pid, PHASES_TID, ts, te, args)]
    primary = [id(d) for d in primary_devices(devs)]
    for d in devs:
        name = counter_name(d)
        ev += _counters(pid, name, [(ts, d.get("bytes_in_use_start")), (te, d.get("bytes_in_use"))])
        if id(d) in primary:  # the peak companion only for the entry sums use
            peak = [(ts, d.get("phase_peak_bytes")), (te, d.get("bytes_in_use"))]
            ev += _counters(pid, f"phase peak {name}", peak)
    rss = host.get("rss_bytes")
    ev += _counters(pid, "host rss", [(ts, host.get("rss_start_bytes")), (te, rss)])
    ev += _counters(pid, "phase peak host rss", [(ts, host.get("rss_peak_bytes")), (te, rss)])
    if r["info"].get("error"):
        where = {"ph": "i", "name": f"error: {r['phase']}", "cat": "error", "pid": pid, "tid": PHASES_TID}
        ev.append(where | {"ts": te, "s": "t", "args": {"error": summarize(str(r["info"]["error"]))}})
    return ev


def _step_spans(a: Attempt, pid: int, t0: float) -> list[dict[str, Any]]:
    spans: dict[int, list[float]] = {}
    for r in a.records:
        if r["step"] is not None:
            lo_hi = spans.setdefault(r["step"], [r["t_start"], r["t_end"]])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], r["t_start"]), max(lo_hi[1], r["t_end"])
    return [
        _slice(f"step {s}", "step", pid, STEPS_TID, _us(lo, t0), _us(hi, t0), {"step": s, "attempt": a.shown})
        for s, (lo, hi) in spans.items()
    ]


def _metadata(pid: int, name: str, sort: int) -> list[dict[str, Any]]:
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": sort}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": PHASES_TID, "args": {"name": "phases"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": STEPS_TID, "args": {"name": "steps"}},
    ]


def build_trace(
    runs: list[tuple[str, float | None, dict[int, list[Attempt]]]], other: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The trace of ``runs`` = ``[(label, t0, attempts per process)]``; each run's time starts at 0."""
    events: list[dict[str, Any]] = []
    for ri, (label, t0, attempts) in enumerate(runs):
        for p, atts in sorted(attempts.items()):
            pid = 1 + ri * 1000 + p
            events += _metadata(pid, f"rank {p}" if len(runs) == 1 else f"{label} rank {p}", pid)
            if t0 is None:
                continue
            for a in atts:
                for r in a.records:
                    events += _record_events(r, pid, t0, a.shown)
                events += _step_spans(a, pid, t0)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other or {}}

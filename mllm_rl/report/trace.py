"""Perfetto / Chrome trace JSON (``trace.json``) merged from every process's phase file.

Opens in https://ui.perfetto.dev (or ``chrome://tracing``). One process track per run and rank,
with thread ``phases`` (one ``X`` event per record, µs from the run's first record, ``args``: step,
attempt, info summary, memory), thread ``steps`` (one span per RL step and attempt), ``C``
counters of bytes in use per device entry (the primary entry and host RSS also get a ``phase
peak`` companion) and an ``i`` instant where a phase failed. ``null`` values add no counter point."""

from __future__ import annotations

from typing import Any

from mllm_rl.phases.jsonsafe import dumps
from mllm_rl.report.load import Attempt, Record
from mllm_rl.report.memory import TRUTH, device_name, primary_devices

PHASES_TID, STEPS_TID = 1, 2
MAX_STR = 200


def pid_of(run_index: int, process: int) -> int:
    return 1 + run_index * 1000 + process


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def summarize(v: Any) -> Any:
    """A short, JSON-safe version of an ``info`` value for trace args."""
    if v is None or isinstance(v, (bool, int, float)):
        return v
    if isinstance(v, str):
        return v if len(v) <= MAX_STR else v[:MAX_STR] + "..."
    if (
        isinstance(v, (list, tuple))
        and len(v) <= 8
        and all(isinstance(x, (bool, int, float, str)) for x in v)
    ):
        return [summarize(x) for x in v]
    if isinstance(v, (list, tuple)):
        return f"[{len(v)} items]"
    text = dumps(v)
    return text if len(text) <= MAX_STR else text[:MAX_STR] + "..."


def counter_name(d: dict[str, Any]) -> str:
    if d.get("source") == TRUTH:
        return f"device truth {device_name(d)} ({TRUTH})"
    return f"mem {device_name(d)} ({d.get('source')})"


def _memory_args(r: Record) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d in r["memory"]["devices"]:
        out[f"{device_name(d)} ({d.get('source')})"] = {
            "before": d.get("bytes_in_use_start"),
            "after": d.get("bytes_in_use"),
            "peak": d.get("phase_peak_bytes"),
            "limit": d.get("bytes_limit"),
        }
    h = r["memory"]["host"]
    out["host rss"] = {
        "before": h.get("rss_start_bytes"),
        "after": h.get("rss_bytes"),
        "peak": h.get("rss_peak_bytes"),
    }
    return out


def _counter(pid: int, name: str, ts: float, value: Any) -> dict[str, Any] | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    return {"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": ts, "args": {"bytes": value}}


def _record_events(r: Record, pid: int, t0: float, attempt: int | None) -> list[dict[str, Any]]:
    ts, te = _us(r["t_start"], t0), _us(r["t_end"], t0)
    args: dict[str, Any] = {
        "step": r["step"],
        "idx": r["idx"],
        "attempt": attempt,
        "info": {k: summarize(v) for k, v in r["info"].items()},
        "memory": _memory_args(r),
    }
    ev: list[dict[str, Any] | None] = [
        {
            "ph": "X",
            "name": r["phase"],
            "cat": "phase",
            "pid": pid,
            "tid": PHASES_TID,
            "ts": ts,
            "dur": max(0.0, round(te - ts, 3)),
            "args": args,
        }
    ]
    primary = [id(d) for d in primary_devices(r["memory"]["devices"])]
    for d in r["memory"]["devices"]:
        name = counter_name(d)
        ev += [
            _counter(pid, name, ts, d.get("bytes_in_use_start")),
            _counter(pid, name, te, d.get("bytes_in_use")),
        ]
        if id(d) in primary:  # the peak companion only for the entry sums use
            ev += [
                _counter(pid, f"phase peak {name}", ts, d.get("phase_peak_bytes")),
                _counter(pid, f"phase peak {name}", te, d.get("bytes_in_use")),
            ]
    h = r["memory"]["host"]
    ev += [
        _counter(pid, "host rss", ts, h.get("rss_start_bytes")),
        _counter(pid, "host rss", te, h.get("rss_bytes")),
        _counter(pid, "phase peak host rss", ts, h.get("rss_peak_bytes")),
        _counter(pid, "phase peak host rss", te, h.get("rss_bytes")),
    ]
    if r["info"].get("error"):
        ev.append(
            {
                "ph": "i",
                "name": f"error: {r['phase']}",
                "cat": "error",
                "pid": pid,
                "tid": PHASES_TID,
                "ts": te,
                "s": "t",
                "args": {"error": summarize(str(r["info"]["error"]))},
            }
        )
    return [e for e in ev if e is not None]


def _step_spans(a: Attempt, pid: int, t0: float) -> list[dict[str, Any]]:
    spans: dict[int, list[float]] = {}
    for r in a.records:
        if r["step"] is not None:
            lo_hi = spans.setdefault(r["step"], [r["t_start"], r["t_end"]])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], r["t_start"]), max(lo_hi[1], r["t_end"])
    return [
        {
            "ph": "X",
            "name": f"step {s}",
            "cat": "step",
            "pid": pid,
            "tid": STEPS_TID,
            "ts": _us(lo, t0),
            "dur": max(0.0, round(_us(hi, t0) - _us(lo, t0), 3)),
            "args": {"step": s, "attempt": a.shown},
        }
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
            pid = pid_of(ri, p)
            name = f"rank {p}" if len(runs) == 1 else f"{label} rank {p}"
            events += _metadata(pid, name, pid)
            if t0 is None:
                continue
            for a in atts:
                for r in a.records:
                    events += _record_events(r, pid, t0, a.shown)
                events += _step_spans(a, pid, t0)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other or {}}

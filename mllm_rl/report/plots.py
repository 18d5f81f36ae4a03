"""The report's charts, built from a ``RunAnalysis``: HTML snippets (legend + SVG), reused by W&B."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from html import escape
from typing import Any

from mllm_rl.report.analysis import RunAnalysis
from mllm_rl.report.attempts import Attempt
from mllm_rl.report.load import Record
from mllm_rl.report.memory import TRUTH, device_name, primary_devices
from mllm_rl.report.svg import BarSeries, LineSeries, bar_chart, color, legend, line_chart

MAX_PROCESS_CHARTS = 8


def _wrap(svg: str) -> str:
    return f'<div class="scroll">{svg}</div>'


def _procs(an: RunAnalysis) -> tuple[list[int], str]:
    procs = [p for p in sorted(an.attempts) if an.attempts[p]]
    note = ""
    if len(procs) > MAX_PROCESS_CHARTS:
        note = (
            f'<p class="muted small">Charts show processes {procs[0]}-{procs[MAX_PROCESS_CHARTS - 1]} of '
            f"{len(procs)}; every process is in the phase table and trace.json.</p>"
        )
    return procs[:MAX_PROCESS_CHARTS], note


def _flat(atts: list[Attempt]) -> list[tuple[Attempt, Record]]:
    return [(a, r) for a in atts for r in a.records]


def _marks(recs: list[tuple[Attempt, Record]]) -> list[tuple[int, str]]:
    """Separators where a step or an attempt begins."""
    out, prev_step, prev_att = [], None, recs[0][0].number if recs else None
    for i, (a, r) in enumerate(recs):
        if a.number != prev_att:
            out.append((i, f"attempt {a.number}"))
        elif r["step"] is not None and r["step"] != prev_step:
            out.append((i, f"step {r['step']}"))
        prev_step, prev_att = r["step"], a.number
    return out


def _device_keys(recs: list[tuple[Attempt, Record]], primary_only: bool) -> list[tuple[Any, str, str]]:
    """``(id, source, label)`` of every device entry, first-appearance order."""
    keys: dict[tuple[Any, str], str] = {}
    for _, r in recs:
        devs = primary_devices(r["memory"]["devices"]) if primary_only else r["memory"]["devices"]
        for d in devs:
            keys.setdefault((d.get("id"), str(d.get("source"))), f"{device_name(d)} ({d.get('source')})")
    return [(k[0], k[1], v) for k, v in keys.items()]


def _entry(r: Record, dev_id: Any, source: str) -> dict[str, Any] | None:
    return next(
        (d for d in r["memory"]["devices"] if d.get("id") == dev_id and d.get("source") == source), None
    )


def _scaled(v: int | None, div: int) -> float | None:
    return None if v is None else v / div


def _value_fmt(unit: str) -> Callable[[float], str]:
    """Hover text of a chart value: ``1.234 GiB``."""
    return lambda v: f"{v:.3f} {unit}"


Chart = tuple[str, list[tuple[str, str, str]], str]  # (caption, legend items, svg)


def _per_process_charts(
    an: RunAnalysis, chart: Callable[[list[tuple[Attempt, Record]]], Chart | None]
) -> str:
    """One ``chart`` per charted process (``None``: no device memory recorded), captioned and with its legend."""
    procs, note = _procs(an)
    out = [note]
    for p in procs:
        made = chart(_flat(an.attempts[p]))
        if made is None:
            out.append(f'<p class="muted">process {p}: no device memory recorded.</p>')
            continue
        caption, items, svg = made
        out.append(f'<div class="small"><b>process {p}</b> - {caption}</div>' + legend(items) + _wrap(svg))
    return "\n".join(out)


def memory_per_phase_charts(an: RunAnalysis) -> str:
    """Per process: a group of bars per phase record, one bar per device (bytes in use at the
    end of the phase), a dark tick at the phase's peak."""
    div, uname = an.unit

    def chart(recs: list[tuple[Attempt, Record]]) -> Chart | None:
        keys = _device_keys(recs, primary_only=True)
        if not keys:
            return None
        series = []
        for i, (dev_id, source, label) in enumerate(keys):
            entries = [_entry(r, dev_id, source) for _, r in recs]
            series.append(
                BarSeries(
                    label,
                    [None if e is None else _scaled(e.get("bytes_in_use"), div) for e in entries],
                    [None if e is None else _scaled(e.get("phase_peak_bytes"), div) for e in entries],
                    color(i),
                )
            )
        svg = bar_chart(
            [r["phase"] for _, r in recs], series, uname, marks=_marks(recs), value_fmt=_value_fmt(uname)
        )
        items = [(s.name, s.color, "bar") for s in series] + [("peak during the phase", "", "peak")]
        return "bar: bytes in use at the end of the phase", items, svg

    return _per_process_charts(an, chart)


def _step_starts(recs: list[tuple[Attempt, Record]], t0: float) -> list[tuple[float, str]]:
    return [(recs[i][1]["t_start"] - t0, text) for i, text in _marks(recs)]


def _phase_spans(recs: list[tuple[Attempt, Record]], t0: float) -> list[tuple[float, float, str]]:
    """Shaded phase ranges (all of them: labels are drawn only where they fit)."""
    return [
        (
            r["t_start"] - t0,
            r["t_end"] - t0,
            r["phase"] if r["step"] is None else f"{r['phase']} @{r['step']}",
        )
        for _, r in recs
    ]


def memory_over_time_charts(an: RunAnalysis) -> str:
    """Per process: bytes in use per device entry over seconds since the run began (start and end of
    every phase); the band over each phase is its peak. Secondary sources (CUDA allocator next to
    ``mem_get_info``) are dashed in the device's color."""
    t0 = an.run.t0
    if t0 is None:
        return '<p class="muted">No records.</p>'
    div, uname = an.unit

    def chart(recs: list[tuple[Attempt, Record]]) -> Chart | None:
        prim = _device_keys(recs, primary_only=True)
        keys = _device_keys(recs, primary_only=False)
        if not keys:
            return None
        dev_color = {k[0]: color(i) for i, k in enumerate(prim)}
        prim_set = {(k[0], k[1]) for k in prim}
        series = []
        for dev_id, source, label in keys:
            pts: list[tuple[float, float | None]] = []
            bands = []
            for _, r in recs:
                e = _entry(r, dev_id, source)
                ts, te = r["t_start"] - t0, r["t_end"] - t0
                if e is None:
                    pts.append((ts, None))
                    continue
                pts += [
                    (ts, _scaled(e.get("bytes_in_use_start"), div)),
                    (te, _scaled(e.get("bytes_in_use"), div)),
                ]
                if (dev_id, source) in prim_set and e.get("phase_peak_bytes") is not None:
                    bands.append((ts, te, e["phase_peak_bytes"] / div))
            pts = [
                (x, y) for i, (x, y) in enumerate(pts) if y is not None or i == 0 or pts[i - 1][1] is not None
            ]
            name = f"{label} device truth" if source == TRUTH else label
            series.append(
                LineSeries(
                    name,
                    pts,
                    dev_color.get(dev_id, color(0)),
                    dashed=(dev_id, source) not in prim_set,
                    bands=bands,
                )
            )
        svg = line_chart(
            series,
            "seconds since the run began",
            uname,
            marks=_step_starts(recs, t0),
            spans=_phase_spans(recs, t0),
            value_fmt=_value_fmt(uname),
        )
        items = [(s.name, s.color, "dash" if s.dashed else "line") for s in series]
        return "faint band: the phase's peak", items, svg

    return _per_process_charts(an, chart)


def host_over_time_chart(an: RunAnalysis) -> str:
    """Host RSS per process over time; the band over each phase is its RSS peak."""
    t0 = an.run.t0
    if t0 is None:
        return '<p class="muted">No records.</p>'
    div, uname = an.host_unit
    procs, _ = _procs(an)
    series = []
    for i, p in enumerate(procs):
        pts: list[tuple[float, float | None]] = []
        bands = []
        for _, r in _flat(an.attempts[p]):
            h = r["memory"]["host"]
            ts, te = r["t_start"] - t0, r["t_end"] - t0
            pts += [(ts, _scaled(h.get("rss_start_bytes"), div)), (te, _scaled(h.get("rss_bytes"), div))]
            if h.get("rss_peak_bytes") is not None:
                bands.append((ts, te, h["rss_peak_bytes"] / div))
        series.append(
            LineSeries(f"process {p} rss", [x for x in pts if x[1] is not None], color(i), bands=bands)
        )
    svg = line_chart(series, "seconds since the run began", uname, height=200, value_fmt=_value_fmt(uname))
    return legend([(s.name, s.color, "line") for s in series]) + _wrap(svg)


def metric_charts(an: RunAnalysis) -> str:
    """Small multiples: each per-step metric over steps."""
    cells = []
    for i, m in enumerate(an.metrics):
        pts = [(float(s), v) for s, v in m["points"]]
        svg = line_chart(
            [LineSeries(m["name"], pts, color(i), dots=True)],
            "step",
            "",
            width=400,
            height=170,
            y_from_zero=False,
            x_integer=True,
        )
        cells.append(f'<div class="cell"><div class="small"><b>{escape(m["name"])}</b></div>{svg}</div>')
    return '<div class="grid">' + "".join(cells) + "</div>"


def compare_charts(analyses: Sequence[RunAnalysis], rows: list[dict[str, Any]], unit: tuple[int, str]) -> str:
    """Grouped bars per phase, one bar per run: bytes after (peak tick), and seconds."""
    div, uname = unit
    groups = [r["phase"] for r in rows]
    marks, prev = [], None
    for i, r in enumerate(rows):
        if r["step"] is not None and r["step"] != prev:
            marks.append((i, f"step {r['step']}"))
        prev = r["step"]

    def values(key: str, i: int, scale: float) -> list[float | None]:
        return [None if (v := r["runs"][i]) is None or v.get(key) is None else v[key] / scale for r in rows]

    mem = [
        BarSeries(an.run.label, values("after_bytes", i, div), values("peak_bytes", i, div), color(i))
        for i, an in enumerate(analyses)
    ]
    secs = [BarSeries(an.run.label, values("seconds", i, 1.0), [], color(i)) for i, an in enumerate(analyses)]
    items = [(an.run.label, color(i), "bar") for i, an in enumerate(analyses)]
    return (
        '<div class="small"><b>memory</b> - bar: bytes in use at the end of the phase (all devices)</div>'
        + legend([*items, ("peak during the phase", "", "peak")])
        + _wrap(bar_chart(groups, mem, uname, marks=marks, value_fmt=_value_fmt(uname)))
        + '<div class="small"><b>time</b> - seconds of the slowest process</div>'
        + legend(items)
        + _wrap(bar_chart(groups, secs, "s", marks=marks, height=240, value_fmt=_value_fmt("s")))
    )

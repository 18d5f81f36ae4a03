"""The report's charts as inline SVG (docs/REPORT.md says why), reused by W&B. Unknown values are
never drawn as 0: a bar shows a small ``-``, a line is broken. Hover text: ``<title>``."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape
from typing import Any

from mllm_rl.report.analysis import RunAnalysis
from mllm_rl.report.load import Record
from mllm_rl.report.memory import TRUTH, device_name, primary_devices

PALETTE = tuple("#4e79a7 #f28e2b #59a14f #e15759 #76b7b2 #b07aa1 #edc948 #9c755f #ff9da7 #bab0ac".split())
AXIS, GRID, TEXT = "#555", "#e3e3e3", "#222"
FONT = 'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif" font-size="11"'
MAX_PROCESS_CHARTS = 8
SWATCH = {  # legend swatch style per kind; {} is the color
    "bar": "background:{}",
    "line": "height:2px;background:{};margin-bottom:4px",
    "dash": "height:0;border-top:2px dashed {};margin-bottom:4px",
    "peak": f"height:3px;background:{TEXT};margin-bottom:3px",
}


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _svg(width: float, height: float) -> str:
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" {FONT}>'


def _tick(v: float) -> str:
    return f"{v:.4g}"


def _in(unit: str) -> Callable[[float], str]:
    """Hover text of a chart value: ``1.234 GiB``."""
    return lambda v: f"{v:.3f} {unit}"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering ``[lo, hi]``."""
    if not hi > lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    v, out = math.floor(lo / step) * step, []
    while True:
        out.append(round(v, 12))
        if v >= hi - step * 1e-9:
            return out
        v += step


@dataclass
class BarSeries:
    name: str
    values: list[float | None]  # one per group, already in display units
    peaks: list[float | None]  # one per group, or none at all
    color: str


@dataclass
class LineSeries:
    name: str
    points: list[tuple[float, float | None]]  # (x, y); y None breaks the line
    color: str
    dashed: bool = False
    bands: list[tuple[float, float, float]] = field(default_factory=list)  # (x0, x1, y) held levels
    dots: bool = False


def _el(tag: str, content: str | None = None, **attrs: Any) -> str:
    """One SVG element: ``_`` in an attribute name is ``-``, a float is written with one decimal."""
    a = " ".join(
        f'{k.replace("_", "-")}="{f"{v:.1f}" if isinstance(v, float) else v}"' for k, v in attrs.items()
    )
    return f"<{tag} {a}/>" if content is None else f"<{tag} {a}>{content}</{tag}>"


def _title(text: str) -> str:
    return f"<title>{escape(text)}</title>"


def _y_axis(ticks: list[float], y: Callable[[float], float], left: int, right: int, label: str) -> list[str]:
    out = []
    for t in ticks:
        out.append(_el("line", x1=left, x2=right, y1=y(t), y2=y(t), stroke=GRID))
        out.append(_el("text", _tick(t), x=left - 6, y=y(t) + 4, text_anchor="end", fill=AXIS))
    return out + ([_el("text", escape(label), x=12, y=y(ticks[-1]) - 10, fill=AXIS)] if label else [])


def bar_chart(
    groups: Sequence[str],
    series: Sequence[BarSeries],
    y_label: str,
    value_fmt: Callable[[float], str],
    marks: Sequence[tuple[int, str]] = (),
    height: int = 260,
) -> str:
    """Grouped bars, one group per label, one bar per series, a dark tick at each peak; ``marks``:
    ``(group index, text)`` separators drawn before that group (e.g. ``step 2``)."""
    n, k = len(groups), max(1, len(series))
    bw = 18 if n * k <= 24 else 12 if n * k < 60 else 7
    gw = max(18, k * bw + 8)
    label_h = min(150, 10 + 6 * max((len(g) for g in groups), default=4))
    left, top, plot_h = 64, 24, height - label_h - 24
    width = max(420, left + 16 + n * gw)
    known = [v for s in series for v in (*s.values, *s.peaks) if v is not None]
    ticks = nice_ticks(0.0, max(known) if known else 1.0)

    def y(v: float) -> float:
        return top + plot_h - (v / ticks[-1]) * plot_h

    out, base = [_svg(width, height), *_y_axis(ticks, y, left, width - 16, y_label)], y(0.0)
    for gi, g in enumerate(groups):
        for si, s in enumerate(series):
            v, p = s.values[gi], s.peaks[gi] if s.peaks else None
            x = left + gi * gw + (gw - k * bw) / 2 + si * bw
            tip = f"{g} - {s.name}: {'-' if v is None else value_fmt(v)}"
            tip += f", peak {'-' if p is None else value_fmt(p)}" if s.peaks else ""
            if v is None:
                title = "-" + _title(f"{tip} (not measurable)")
                out.append(_el("text", title, x=x + bw / 2, y=base - 2, text_anchor="middle", fill="#999"))
            else:
                h = max(0.0, base - y(v))
                out.append(_el("rect", _title(tip), x=x, y=y(v), width=bw - 1, height=h, fill=s.color))
            if p is not None:
                tick = dict(x1=x - 1, x2=x + bw, y1=y(p), y2=y(p), stroke=TEXT, stroke_width=2.5)
                out.append(_el("line", _title(tip), **tick))
        at = f"translate({left + gi * gw + gw / 2:.1f},{base + 10:.1f}) rotate(-55)"
        out.append(_el("text", escape(g), transform=at, text_anchor="end", fill=TEXT))
    for gi, text in marks:
        x = left + gi * gw
        out.append(_el("line", x1=x, x2=x, y1=top - 8, y2=base, stroke="#999", stroke_dasharray="3,3"))
        out.append(_el("text", escape(text), x=x + 3, y=top - 10, fill=AXIS))
    out += [_el("line", x1=left, x2=width - 16, y1=base, y2=base, stroke=AXIS), "</svg>"]
    return "\n".join(out)


def line_chart(
    series: Sequence[LineSeries],
    x_label: str,
    y_label: str,
    value_fmt: Callable[[float], str] = _tick,
    marks: Sequence[tuple[float, str]] = (),
    spans: Sequence[tuple[float, float, str]] = (),
    width: int = 1280,
    height: int = 240,
    metric: bool = False,
) -> str:
    """Lines over a numeric x; ``spans`` shade ``(x0, x1, label)`` ranges (phases) in alternating grey.
    ``metric``: y not from 0 and x ticks on whole numbers only (a metric over steps)."""
    xs = [x for s in series for x, _ in s.points] + [x for s in series for b in s.bands for x in b[:2]]
    ys = [v for s in series for _, v in s.points if v is not None] + [b[2] for s in series for b in s.bands]
    left, right, top, bottom = 64, 16, 24, 36
    if not xs or not ys:
        return _svg(width, 40) + _el("text", "- (nothing measured)", x=8, y=24, fill=AXIS) + "</svg>"
    x_lo, x_hi = min(xs), max(xs)
    x_hi = x_hi if x_hi > x_lo else x_lo + 1.0
    y_lo, y_hi = min(ys) if metric else 0.0, max(ys)
    if metric:
        pad = (y_hi - y_lo) * 0.08 or abs(y_hi) * 0.1 or 1.0
        y_lo, y_hi = y_lo - pad, y_hi + pad
    ticks = nice_ticks(y_lo, y_hi)
    y_lo, y_hi = ticks[0], ticks[-1]
    plot_w, plot_h = width - left - right, height - top - bottom

    def X(x: float) -> float:  # noqa: N802
        return left + (x - x_lo) / (x_hi - x_lo) * plot_w

    def Y(v: float) -> float:  # noqa: N802
        return top + plot_h - (v - y_lo) / ((y_hi - y_lo) or 1.0) * plot_h

    out = [_svg(width, height)]
    for i, (x0, x1, label) in enumerate(spans):
        w = max(X(x1) - X(x0), 0.5)
        fill = "#f3f3f3" if i % 2 == 0 else "#fafafa"
        out.append(_el("rect", _title(label), x=X(x0), y=top, width=w, height=plot_h, fill=fill))
        if w > 6.5 * len(label) + 6:
            out.append(_el("text", escape(label), x=X(x0) + 3, y=top + 11, fill="#888"))
    out += _y_axis(ticks, Y, left, width - right, y_label)
    x_ticks = nice_ticks(x_lo, x_hi, 8)
    if metric:
        x_ticks = (
            [t for t in x_ticks if t == int(t)] if x_hi - x_lo > 8 else list(range(int(x_lo), int(x_hi) + 1))
        )
    for t in (t for t in x_ticks if x_lo <= t <= x_hi):
        out.append(_el("text", _tick(t), x=X(t), y=height - bottom + 14, text_anchor="middle", fill=AXIS))
    out.append(_el("text", escape(x_label), x=width - right, y=height - 4, text_anchor="end", fill=AXIS))
    for x, text in marks:
        line = _el("line", x1=X(x), x2=X(x), y1=top, y2=top + plot_h, stroke="#aaa", stroke_dasharray="3,3")
        out.append(line + _el("text", escape(text), x=X(x) + 3, y=top - 6, fill=AXIS))
    for s in series:
        for x0, x1, v in s.bands:
            t, band = _title(f"{s.name} phase peak {value_fmt(v)}"), dict(x1=X(x0), x2=max(X(x1), X(x0) + 2))
            out.append(
                _el("line", t, **band, y1=Y(v), y2=Y(v), stroke=s.color, stroke_width=3, opacity="0.45")
            )
        style = {"fill": "none", "stroke": s.color, "stroke_width": 1.6}
        style |= {"stroke_dasharray": "5,3"} if s.dashed else {}
        seg: list[tuple[float, float]] = []
        for x, v in [*s.points, (math.nan, None)]:
            if v is not None:
                seg.append((X(x), Y(v)))
                if s.dots:
                    title = _title(f"{s.name} @ {_tick(x)}: {value_fmt(v)}")
                    out.append(_el("circle", title, cx=X(x), cy=Y(v), r=2.5, fill=s.color))
                continue
            if len(seg) > 1:
                points = " ".join(f"{a:.1f},{b:.1f}" for a, b in seg)
                out.append(_el("polyline", _title(s.name), **style, points=points))
            elif seg:
                out.append(_el("circle", cx=seg[0][0], cy=seg[0][1], r=2, fill=s.color))
            seg = []
    out += [_el("line", x1=left, x2=width - right, y1=top + plot_h, y2=top + plot_h, stroke=AXIS), "</svg>"]
    return "\n".join(out)


def legend(items: Sequence[tuple[str, str, str]]) -> str:
    """HTML legend: ``(label, color, kind)`` with kind ``bar``, ``line``, ``dash`` or ``peak``."""
    parts = [
        f'<span class="li"><span class="sw" style="{SWATCH[kind].format(col)}"></span>{escape(label)}</span>'
        for label, col, kind in items
    ]
    return f'<div class="legend">{"".join(parts)}</div>'


def _wrap(svg: str) -> str:
    return f'<div class="scroll">{svg}</div>'


def _scaled(v: int | None, div: int) -> float | None:
    return None if v is None else v / div


def _marks(keys: Sequence[tuple[int, int | None]]) -> list[tuple[int, str]]:
    """Separators where an attempt or a step begins, from ``(attempt, step)`` per group."""
    out, prev_step, prev_att = [], None, keys[0][0] if keys else None
    for i, (att, step) in enumerate(keys):
        if att != prev_att:
            out.append((i, f"attempt {att}"))
        elif step is not None and step != prev_step:
            out.append((i, f"step {step}"))
        prev_step, prev_att = step, att
    return out


def _procs(an: RunAnalysis) -> tuple[list[int], str]:
    procs = [p for p in sorted(an.attempts) if an.attempts[p]]
    note = ""
    if len(procs) > MAX_PROCESS_CHARTS:
        note = (
            f'<p class="muted small">Charts show processes {procs[0]}-{procs[MAX_PROCESS_CHARTS - 1]} of '
            f"{len(procs)}; every process is in the phase table and trace.json.</p>"
        )
    return procs[:MAX_PROCESS_CHARTS], note


def _levels(
    recs: list[Record],
    t0: float,
    div: int,
    entries: list[dict[str, Any] | None],
    keys: tuple[str, str, str | None],
) -> tuple[list[tuple[float, float | None]], list[tuple[float, float, float]]]:
    """Line points (``keys[0]`` at a record's start, ``keys[1]`` at its end; a missing entry breaks
    the line) and bands (``keys[2]``: the peak over the record)."""
    pts: list[tuple[float, float | None]] = []
    bands = []
    for r, e in zip(recs, entries, strict=True):
        ts, te = r["t_start"] - t0, r["t_end"] - t0
        if e is None:
            pts.append((ts, None))
            continue
        pts += [(ts, _scaled(e.get(keys[0]), div)), (te, _scaled(e.get(keys[1]), div))]
        if keys[2] and e.get(keys[2]) is not None:
            bands.append((ts, te, e[keys[2]] / div))
    return pts, bands


Chart = tuple[str, list[tuple[str, str, str]], str]  # (caption, legend items, svg)


def _per_process_charts(
    an: RunAnalysis, chart: Callable[[list[Record], list[tuple[int, str]]], Chart | None]
) -> str:
    """One ``chart(records, marks)`` per charted process (``None``: no device memory recorded)."""
    procs, note = _procs(an)
    out = [note]
    for p in procs:
        pairs = [(a, r) for a in an.attempts[p] for r in a.records]
        made = chart([r for _, r in pairs], _marks([(a.number, r["step"]) for a, r in pairs]))
        if made is None:
            out.append(f'<p class="muted">process {p}: no device memory recorded.</p>')
            continue
        caption, items, svg = made
        out.append(f'<div class="small"><b>process {p}</b> - {caption}</div>' + legend(items) + _wrap(svg))
    return "\n".join(out)


def _device_keys(recs: list[Record], primary_only: bool) -> list[tuple[Any, str, str]]:
    """``(id, source, label)`` of every device entry, first-appearance order."""
    keys: dict[tuple[Any, str], str] = {}
    for r in recs:
        for d in primary_devices(r["memory"]["devices"]) if primary_only else r["memory"]["devices"]:
            keys.setdefault((d.get("id"), str(d.get("source"))), f"{device_name(d)} ({d.get('source')})")
    return [(*k, v) for k, v in keys.items()]


def _entry(r: Record, dev_id: Any, source: str) -> dict[str, Any] | None:
    return next(
        (d for d in r["memory"]["devices"] if (d.get("id"), d.get("source")) == (dev_id, source)), None
    )


def memory_per_phase_charts(an: RunAnalysis) -> str:
    """Per process: a bar per phase record and device (bytes in use at its end), a tick at its peak."""
    div, uname = an.unit

    def chart(recs: list[Record], marks: list[tuple[int, str]]) -> Chart | None:
        series = []
        for i, (dev_id, source, label) in enumerate(_device_keys(recs, primary_only=True)):
            entries = [_entry(r, dev_id, source) for r in recs]
            at_end = [None if e is None else _scaled(e.get("bytes_in_use"), div) for e in entries]
            peaks = [None if e is None else _scaled(e.get("phase_peak_bytes"), div) for e in entries]
            series.append(BarSeries(label, at_end, peaks, color(i)))
        if not series:
            return None
        svg = bar_chart([r["phase"] for r in recs], series, uname, _in(uname), marks=marks)
        items = [(s.name, s.color, "bar") for s in series] + [("peak during the phase", "", "peak")]
        return "bar: bytes in use at the end of the phase", items, svg

    return _per_process_charts(an, chart)


def memory_over_time_charts(an: RunAnalysis) -> str:
    """Per process: bytes in use per device entry over time, a band at each phase's peak; secondary
    sources (CUDA allocator next to ``mem_get_info``) dashed in the device's color."""
    t0 = an.run.t0
    if t0 is None:
        return '<p class="muted">No records.</p>'
    div, uname = an.unit

    def chart(recs: list[Record], marks: list[tuple[int, str]]) -> Chart | None:
        prim = _device_keys(recs, primary_only=True)
        dev_color = {k[0]: color(i) for i, k in enumerate(prim)}
        prim_set = {(k[0], k[1]) for k in prim}
        series = []
        for dev_id, source, label in _device_keys(recs, primary_only=False):
            primary = (dev_id, source) in prim_set
            keys = ("bytes_in_use_start", "bytes_in_use", "phase_peak_bytes" if primary else None)
            pts, bands = _levels(recs, t0, div, [_entry(r, dev_id, source) for r in recs], keys)
            pts = [
                (x, y) for i, (x, y) in enumerate(pts) if y is not None or i == 0 or pts[i - 1][1] is not None
            ]
            name = f"{label} device truth" if source == TRUTH else label
            series.append(LineSeries(name, pts, dev_color.get(dev_id, color(0)), not primary, bands))
        if not series:
            return None
        names = [r["phase"] + ("" if r["step"] is None else f" @{r['step']}") for r in recs]
        svg = line_chart(
            series,
            "seconds since the run began",
            uname,
            _in(uname),
            marks=[(recs[i]["t_start"] - t0, text) for i, text in marks],
            spans=[(r["t_start"] - t0, r["t_end"] - t0, name) for r, name in zip(recs, names, strict=True)],
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
    series = []
    for i, p in enumerate(_procs(an)[0]):
        recs = [r for a in an.attempts[p] for r in a.records]
        hosts = [r["memory"]["host"] for r in recs]
        pts, bands = _levels(recs, t0, div, hosts, ("rss_start_bytes", "rss_bytes", "rss_peak_bytes"))
        pts = [x for x in pts if x[1] is not None]
        series.append(LineSeries(f"process {p} rss", pts, color(i), bands=bands))
    svg = line_chart(series, "seconds since the run began", uname, _in(uname), height=200)
    return legend([(s.name, s.color, "line") for s in series]) + _wrap(svg)


def metric_charts(an: RunAnalysis) -> str:
    """Small multiples: each per-step metric over steps."""
    cells = []
    for i, m in enumerate(an.metrics):
        series = LineSeries(m["name"], [(float(s), v) for s, v in m["points"]], color(i), dots=True)
        svg = line_chart([series], "step", "", width=400, height=170, metric=True)
        cells.append(f'<div class="cell"><div class="small"><b>{escape(m["name"])}</b></div>{svg}</div>')
    return '<div class="grid">' + "".join(cells) + "</div>"


def compare_charts(analyses: Sequence[RunAnalysis], rows: list[dict[str, Any]], unit: tuple[int, str]) -> str:
    """Grouped bars per phase, one bar per run: bytes after (peak tick), and seconds."""
    div, uname = unit
    groups, marks = [r["phase"] for r in rows], _marks([(0, r["step"]) for r in rows])

    def values(key: str, i: int, scale: float) -> list[float | None]:
        return [None if (v := r["runs"][i]) is None or v.get(key) is None else v[key] / scale for r in rows]

    mem, secs, items = [], [], []
    for i, an in enumerate(analyses):
        mem.append(
            BarSeries(an.run.label, values("after_bytes", i, div), values("peak_bytes", i, div), color(i))
        )
        secs.append(BarSeries(an.run.label, values("seconds", i, 1.0), [], color(i)))
        items.append((an.run.label, color(i), "bar"))
    return (
        '<div class="small"><b>memory</b> - bar: bytes in use at the end of the phase (all devices)</div>'
        + legend([*items, ("peak during the phase", "", "peak")])
        + _wrap(bar_chart(groups, mem, uname, _in(uname), marks=marks))
        + '<div class="small"><b>time</b> - seconds of the slowest process</div>'
        + legend(items)
        + _wrap(bar_chart(groups, secs, "s", _in("s"), marks=marks, height=240))
    )

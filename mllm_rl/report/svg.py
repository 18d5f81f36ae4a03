"""Hand-written SVG charts (no plotting library): grouped bars with peak markers, lines over x.

Every function returns a self-contained ``<svg>`` string. Unknown values (``None``) are never
drawn as 0: a bar shows a small ``-`` at the baseline, a line is broken. Hovering a bar or a
point shows its exact value (``<title>``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from html import escape

PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#b07aa1",
    "#edc948",
    "#9c755f",
    "#ff9da7",
    "#bab0ac",
)
AXIS, GRID, TEXT = "#555", "#e3e3e3", "#222"
FONT = 'font-family="system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif" font-size="11"'


def color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


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


def _tick(v: float) -> str:
    return f"{v:.4g}"


@dataclass
class BarSeries:
    name: str
    values: list[float | None]  # one per group, already in display units
    peaks: list[float | None] = field(default_factory=list)
    color: str = PALETTE[0]


@dataclass
class LineSeries:
    name: str
    points: list[tuple[float, float | None]]  # (x, y); y None breaks the line
    color: str = PALETTE[0]
    dashed: bool = False
    bands: list[tuple[float, float, float]] = field(default_factory=list)  # (x0, x1, y) held levels
    dots: bool = False


def _y_axis(
    ticks: list[float], y: Callable[[float], float], left: float, right: float, label: str
) -> list[str]:
    out = []
    for t in ticks:
        out.append(f'<line x1="{left}" x2="{right}" y1="{y(t):.1f}" y2="{y(t):.1f}" stroke="{GRID}"/>')
        out.append(
            f'<text x="{left - 6}" y="{y(t) + 4:.1f}" text-anchor="end" fill="{AXIS}">{_tick(t)}</text>'
        )
    if label:
        out.append(f'<text x="12" y="{y(ticks[-1]) - 10:.1f}" fill="{AXIS}">{escape(label)}</text>')
    return out


def bar_chart(
    groups: Sequence[str],
    series: Sequence[BarSeries],
    y_label: str,
    marks: Sequence[tuple[int, str]] = (),
    height: int = 260,
    value_fmt: Callable[[float], str] = _tick,
) -> str:
    """Grouped bars, one group per label, one bar per series, a dark tick at each peak.

    ``marks``: ``(group index, text)`` separators drawn before that group (e.g. ``step 2``).
    """
    n, k = len(groups), max(1, len(series))
    bw = 18 if n * k <= 24 else 12 if n * k < 60 else 7
    gw = max(18, k * bw + 8)
    label_h = min(150, 10 + 6 * max((len(g) for g in groups), default=4))
    left, top, plot_h = 64, 24, height - label_h - 24
    width = max(420, left + 16 + n * gw)
    known = [v for s in series for v in (*s.values, *s.peaks) if v is not None]
    ticks = nice_ticks(0.0, max(known) if known else 1.0)
    vmax = ticks[-1]

    def y(v: float) -> float:
        return top + plot_h - (v / vmax) * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" {FONT}>']
    out += _y_axis(ticks, y, left, width - 16, y_label)
    base = y(0.0)
    for gi, g in enumerate(groups):
        x0 = left + gi * gw + (gw - k * bw) / 2
        for si, s in enumerate(series):
            v = s.values[gi] if gi < len(s.values) else None
            p = s.peaks[gi] if gi < len(s.peaks) else None
            x = x0 + si * bw
            tip = f"{g} - {s.name}: {'-' if v is None else value_fmt(v)}"
            tip += f", peak {'-' if p is None else value_fmt(p)}" if s.peaks else ""
            if v is None:
                out.append(
                    f'<text x="{x + bw / 2:.1f}" y="{base - 2:.1f}" text-anchor="middle" fill="#999">'
                    f"-<title>{escape(tip)} (not measurable)</title></text>"
                )
            else:
                out.append(
                    f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bw - 1}" height="{max(0.0, base - y(v)):.1f}" '
                    f'fill="{s.color}"><title>{escape(tip)}</title></rect>'
                )
            if p is not None:
                out.append(
                    f'<line x1="{x - 1:.1f}" x2="{x + bw:.1f}" y1="{y(p):.1f}" y2="{y(p):.1f}" '
                    f'stroke="{TEXT}" stroke-width="2.5"><title>{escape(tip)}</title></line>'
                )
        cx = left + gi * gw + gw / 2
        out.append(
            f'<text transform="translate({cx:.1f},{base + 10:.1f}) rotate(-55)" text-anchor="end" '
            f'fill="{TEXT}">{escape(g)}</text>'
        )
    for gi, text in marks:
        x = left + gi * gw
        out.append(
            f'<line x1="{x}" x2="{x}" y1="{top - 8}" y2="{base}" stroke="#999" stroke-dasharray="3,3"/>'
        )
        out.append(f'<text x="{x + 3}" y="{top - 10}" fill="{AXIS}">{escape(text)}</text>')
    out.append(f'<line x1="{left}" x2="{width - 16}" y1="{base:.1f}" y2="{base:.1f}" stroke="{AXIS}"/>')
    out.append("</svg>")
    return "\n".join(out)


def line_chart(
    series: Sequence[LineSeries],
    x_label: str,
    y_label: str,
    marks: Sequence[tuple[float, str]] = (),
    spans: Sequence[tuple[float, float, str]] = (),
    width: int = 1280,
    height: int = 240,
    y_from_zero: bool = True,
    value_fmt: Callable[[float], str] = _tick,
    x_integer: bool = False,
) -> str:
    """Lines over a numeric x (``x_integer``: ticks on whole numbers only, e.g. steps); ``bands`` draw a held level (a phase's peak) over an x range;
    ``spans`` shade ``(x0, x1, label)`` ranges (phases) in alternating grey, labelled where they fit."""
    xs = [x for s in series for x, _ in s.points] + [x for s in series for b in s.bands for x in b[:2]]
    ys = [v for s in series for _, v in s.points if v is not None] + [b[2] for s in series for b in s.bands]
    left, right, top, bottom = 64, 16, 24, 36
    if not xs or not ys:
        return (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="40" {FONT}>'
            f'<text x="8" y="24" fill="{AXIS}">- (nothing measured)</text></svg>'
        )
    x_lo, x_hi = min(xs), max(xs)
    if x_hi <= x_lo:
        x_hi = x_lo + 1.0
    y_lo = 0.0 if y_from_zero else min(ys)
    y_hi = max(ys)
    if not y_from_zero:
        pad = (y_hi - y_lo) * 0.08 or abs(y_hi) * 0.1 or 1.0
        y_lo, y_hi = y_lo - pad, y_hi + pad
    ticks = nice_ticks(y_lo, y_hi)
    y_lo, y_hi = ticks[0], ticks[-1]
    plot_w, plot_h = width - left - right, height - top - bottom

    def X(x: float) -> float:  # noqa: N802
        return left + (x - x_lo) / (x_hi - x_lo) * plot_w

    def Y(v: float) -> float:  # noqa: N802
        return top + plot_h - (v - y_lo) / ((y_hi - y_lo) or 1.0) * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" {FONT}>']
    for i, (x0, x1, label) in enumerate(spans):
        w = max(X(x1) - X(x0), 0.5)
        out.append(
            f'<rect x="{X(x0):.1f}" y="{top}" width="{w:.1f}" height="{plot_h}" '
            f'fill="{"#f3f3f3" if i % 2 == 0 else "#fafafa"}"><title>{escape(label)}</title></rect>'
        )
        if w > 6.5 * len(label) + 6:
            out.append(f'<text x="{X(x0) + 3:.1f}" y="{top + 11}" fill="#888">{escape(label)}</text>')
    out += _y_axis(ticks, Y, left, width - right, y_label)
    x_ticks = nice_ticks(x_lo, x_hi, 8)
    if x_integer:
        x_ticks = (
            [t for t in x_ticks if t == int(t)] if x_hi - x_lo > 8 else list(range(int(x_lo), int(x_hi) + 1))
        )
    for t in x_ticks:
        if x_lo <= t <= x_hi:
            out.append(
                f'<text x="{X(t):.1f}" y="{height - bottom + 14}" text-anchor="middle" fill="{AXIS}">'
                f"{_tick(t)}</text>"
            )
    out.append(
        f'<text x="{width - right}" y="{height - 4}" text-anchor="end" fill="{AXIS}">{escape(x_label)}</text>'
    )
    for x, text in marks:
        out.append(
            f'<line x1="{X(x):.1f}" x2="{X(x):.1f}" y1="{top}" y2="{top + plot_h}" stroke="#aaa" '
            f'stroke-dasharray="3,3"/><text x="{X(x) + 3:.1f}" y="{top - 6}" fill="{AXIS}">{escape(text)}</text>'
        )
    for s in series:
        for x0, x1, v in s.bands:
            out.append(
                f'<line x1="{X(x0):.1f}" x2="{max(X(x1), X(x0) + 2):.1f}" y1="{Y(v):.1f}" y2="{Y(v):.1f}" '
                f'stroke="{s.color}" stroke-width="3" opacity="0.45"><title>{escape(s.name)} phase peak '
                f"{value_fmt(v)}</title></line>"
            )
        dash = ' stroke-dasharray="5,3"' if s.dashed else ""
        seg: list[str] = []
        for x, v in [*s.points, (math.nan, None)]:
            if v is None:
                if len(seg) > 1:
                    out.append(
                        f'<polyline fill="none" stroke="{s.color}" stroke-width="1.6"{dash} '
                        f'points="{" ".join(seg)}"><title>{escape(s.name)}</title></polyline>'
                    )
                elif seg:
                    out.append(
                        f'<circle cx="{seg[0].split(",")[0]}" cy="{seg[0].split(",")[1]}" r="2" '
                        f'fill="{s.color}"/>'
                    )
                seg = []
                continue
            seg.append(f"{X(x):.1f},{Y(v):.1f}")
            if s.dots:
                out.append(
                    f'<circle cx="{X(x):.1f}" cy="{Y(v):.1f}" r="2.5" fill="{s.color}">'
                    f"<title>{escape(s.name)} @ {_tick(x)}: {value_fmt(v)}</title></circle>"
                )
    out.append(
        f'<line x1="{left}" x2="{width - right}" y1="{top + plot_h}" y2="{top + plot_h}" stroke="{AXIS}"/>'
    )
    out.append("</svg>")
    return "\n".join(out)


def legend(items: Sequence[tuple[str, str, str]]) -> str:
    """HTML legend: ``(label, color, kind)`` with kind ``bar``, ``line``, ``dash`` or ``peak``."""
    parts = []
    for label, col, kind in items:
        if kind == "peak":
            sw = f'<span class="sw" style="height:3px;background:{TEXT};margin-bottom:3px"></span>'
        elif kind == "dash":
            sw = f'<span class="sw" style="height:0;border-top:2px dashed {col};margin-bottom:4px"></span>'
        elif kind == "line":
            sw = f'<span class="sw" style="height:2px;background:{col};margin-bottom:4px"></span>'
        else:
            sw = f'<span class="sw" style="background:{col}"></span>'
        parts.append(f'<span class="li">{sw}{escape(label)}</span>')
    return f'<div class="legend">{"".join(parts)}</div>'

"""``report.html``: one static, self-contained page (inline CSS and SVG, no script, no network):
findings, the comparison of several runs, then each run's charts and tables. ``-``: not measurable."""

from __future__ import annotations

import time
from collections.abc import Sequence
from html import escape
from typing import Any

from mllm_rl.report.analysis import RunAnalysis
from mllm_rl.report.issues import ERROR, INFO, WARNING, Issue, count, group_issues
from mllm_rl.report.memory import fmt_bytes, fmt_num, fmt_pct, fmt_seconds
from mllm_rl.report.plots import (
    compare_charts,
    host_over_time_chart,
    memory_over_time_charts,
    memory_per_phase_charts,
    metric_charts,
)
from mllm_rl.report.tables import EFFICIENCY_MIN

CSS = """
body{font-family:system-ui,-apple-system,'Segoe UI',Helvetica,Arial,sans-serif;margin:20px 28px;color:#222;
  font-size:14px;line-height:1.4}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:2px solid #ddd;padding-bottom:3px}
h3{font-size:15px;margin:18px 0 6px} .muted{color:#666} .small{font-size:12px}
table{border-collapse:collapse;font-size:12px;margin:4px 0 10px}
th,td{border:1px solid #ddd;padding:2px 7px;text-align:right;white-space:nowrap}
th{background:#f4f4f4} td.l,th.l{text-align:left}
tr.flag td{background:#fde2e1} tr.err td{background:#fff0d9} tr.step td{border-top:2px solid #bbb}
.scroll{overflow-x:auto;max-width:100%} .tablewrap{overflow:auto;max-height:520px}
.badge{display:inline-block;padding:1px 8px;border-radius:9px;font-weight:600;font-size:12px;margin-right:6px}
.b-error{background:#d62728;color:#fff} .b-warning{background:#f0a202;color:#fff} .b-info{background:#9bb;color:#fff}
.b-ok{background:#2ca02c;color:#fff}
ul.issues{margin:4px 0;padding-left:18px} ul.issues li{margin:1px 0}
li.error{color:#b00} li.warning{color:#8a5a00} li.info{color:#555}
.legend{margin:2px 0 4px;font-size:12px} .li{margin-right:14px;white-space:nowrap}
.sw{display:inline-block;width:14px;height:10px;margin-right:4px;vertical-align:middle}
.grid{display:flex;flex-wrap:wrap;gap:6px 18px} .cell{flex:0 0 auto}
dl.meta{display:grid;grid-template-columns:max-content minmax(0,1fr) max-content minmax(0,1fr);gap:0 12px;
  margin:4px 0;font-size:13px;max-width:1300px}
dl.meta dt{color:#666} dl.meta dd{margin:0;overflow-wrap:anywhere}
"""


def _table(
    head: list[str],
    rows: list[list[Any]],
    left: tuple[str, ...],
    wrap: bool = False,
    classes: list[str] | None = None,
) -> str:
    """A table of ``rows`` (escaped here); ``left``: left-aligned columns; ``wrap``: in a scrolling box;
    ``classes``: one row class each."""
    al = [" class=l" if h in left else "" for h in head]
    ths = "".join(f"<th{a}>{escape(h)}</th>" for h, a in zip(head, al, strict=True))
    out = [('<div class="tablewrap">' if wrap else "") + f"<table><tr>{ths}</tr>"]
    for i, row in enumerate(rows):
        cells = "".join(f"<td{a}>{escape(str(v))}</td>" for v, a in zip(row, al, strict=True))
        out.append(("<tr>" if classes is None else f'<tr class="{classes[i]}">') + cells + "</tr>")
    return "\n".join([*out, "</table></div>" if wrap else "</table>"])


def _opt(v: Any) -> str:
    return "-" if v is None else str(v)


def _id_head(multi: bool) -> list[str]:
    """Columns naming a record: process, attempt (``multi``: a process ran more than once), step, phase."""
    return ["process", *(["attempt"] if multi else []), "step", "phase"]


def _id_cells(r: dict[str, Any], multi: bool) -> list[Any]:
    return [r["process"], *([_opt(r["attempt"])] if multi else []), _opt(r["step"]), r["phase"]]


def issues_html(issues: list[Issue], analyses: Sequence[RunAnalysis]) -> str:
    c = count(issues)
    out = ["<h2>Findings</h2>"]
    if c[ERROR] == 0:
        checked = []
        for an in analyses:
            e = an.expected
            steps = f", {len(e.steps)} step(s) x {len(e.step_phases)} phase(s)" if e.steps else ""
            checked.append(
                f"{escape(an.run.label)}: {e.process_count} process(es) x {len(e.phases)} phase(s)"
                f"{steps} (expected from {escape(e.source)})"
            )
        out.append(
            f'<p><span class="badge b-ok">complete</span>every expected phase recorded on every process, '
            f"in order. {'; '.join(checked)}</p>"
        )
    names = {ERROR: "error", WARNING: "warning", INFO: "note"}
    badges = [f'<span class="badge b-{s}">{c[s]} {names[s]}{"s" if c[s] != 1 else ""}</span>' for s in names]
    out.append("<p>" + "".join(badges) + "</p>")
    if any(an.expected.source == "inferred" for an in analyses):
        out.append(
            '<p class="muted small">No run.json: expected phases inferred from the records; a phase '
            "missing on every process cannot be detected.</p>"
        )
    if issues:
        out.append('<ul class="issues">')
        for i, where in group_issues(issues):
            out.append(
                f'<li class="{i.severity}"><b>{escape(i.severity)}</b> [{escape(i.kind)}] '
                f"{escape(i.run)}{' ' + escape(where) if where else ''}: {escape(i.message)}</li>"
            )
        out.append("</ul>")
    return "\n".join(out)


def meta_html(an: RunAnalysis) -> str:
    s = an.summary()
    resumed = {p: n for p, n in s["attempts"].items() if n > 1}
    items = [
        ("run id", s["run_id"]),
        ("backend", s["backend"]),
        ("plan", _opt(s["plan"])),
        ("model", _opt(s["model"])),
        ("processes", f"{len(s['processes'])} recorded / {an.expected.process_count} expected"),
        ("steps", f"{len(an.expected.steps)} expected" if an.expected.steps else "none (no RL steps)"),
        ("records", s["records"]),
        ("wall time", f"{fmt_num(s['wall_seconds'], 2)} s"),
        ("attempts", ", ".join(f"process {p}: {n}" for p, n in resumed.items()) or "1 per process"),
        ("phase files", ", ".join(s["phase_files"])),
        ("directory", s["dir"]),
    ]
    dl = "".join(f"<dt>{escape(k)}</dt><dd>{escape(str(v))}</dd>" for k, v in items)
    return f'<dl class="meta">{dl}</dl>'


def phase_table_html(an: RunAnalysis) -> str:
    u, hunit = an.unit[1], an.host_unit
    multi = any(r["attempt"] is not None for r in an.phases)
    secondary = sorted({s for r in an.phases for s in r["secondary"]})
    head = _id_head(multi) + ["start s", "dur s", f"before {u}", f"after {u}", f"peak {u}", f"delta {u}"]
    head += [f"{s} after {u}" for s in secondary]
    head += [f"host rss {hunit[1]}", f"rss peak {hunit[1]}", "source", "error"]
    rows, classes, prev_step = [], [], object()
    for r in an.phases:
        new_step = r["step"] is not None and r["step"] != prev_step
        classes.append("err" if r["error"] else ("step" if new_step else ""))
        prev_step = r["step"]
        rows.append(
            _id_cells(r, multi)
            + [fmt_num(r["t_offset_s"], 2), fmt_seconds(r["seconds"])]
            + [fmt_bytes(r[k], an.unit) for k in ("before_bytes", "after_bytes", "peak_bytes")]
            + [fmt_bytes(r["delta_bytes"], an.unit, signed=True)]
            + [fmt_bytes(r["secondary"].get(s, {}).get("after"), an.unit) for s in secondary]
            + [fmt_bytes(r["host_rss_bytes"], hunit), fmt_bytes(r["host_rss_peak_bytes"], hunit)]
            + [_opt(r["source"]), (r["error"] or "")[:120]]
        )
    note = (
        '<p class="muted small">Device bytes summed over each process\'s devices, one entry per device (the '
        "most truthful source: mem_get_info, then memory_stats, torch_allocator, live_arrays). peak = the "
        "phase's own peak (sampled), not the allocator's cumulative one.</p>"
    )
    return note + _table(head, rows, ("phase", "error", "source"), wrap=True, classes=classes)


def efficiency_html(an: RunAnalysis) -> str:
    rows = an.efficiency
    if not rows:
        return '<p class="muted">No release/offload/resume/onload phase in this run.</p>'
    unit = an.unit
    flagged, n_free = sum(r["flagged"] for r in rows), sum(r["kind"] == "free" for r in rows)
    multi = any(r["attempt"] is not None for r in rows)
    others = sorted({s for r in rows for s in r["by_source"] if s != r["source"]})
    head = _id_head(multi) + ["kind", "source", f"freed/alloc {unit[1]}", f"expected {unit[1]}", "ratio"]
    head += [f"{s} {unit[1]}" for s in others] + ["note"]
    cells = [
        [*_id_cells(r, multi), r["kind"], _opt(r["source"]), fmt_bytes(r["actual_bytes"], unit)]
        + [fmt_bytes(r["expected_bytes"], unit), fmt_pct(r["ratio"])]
        + [*(fmt_bytes(r["by_source"].get(s), unit) for s in others), r["note"]]
        for r in rows
    ]
    flags = ["flag" if r["flagged"] else "" for r in rows]
    return (
        f"<p>{flagged} of {n_free} release/offload phase(s) flagged (freed below {EFFICIENCY_MIN:.0%} of "
        "<code>expected_freed_bytes</code>, or nothing). Freed = bytes in use at the start minus at the end, "
        "by device truth where recorded.</p>\n"
        + _table(head, cells, ("phase", "note", "kind", "source"), True, flags)
    )


def swap_html(swaps: list[dict[str, Any]], unit: tuple[int, str], with_run: bool = False) -> str:
    head = ["process", "step", "phase", f"peak {unit[1]}", f"steady {unit[1]}", "peak/steady", "weights-only"]
    rows = [
        [r["process"], _opt(r["step"]), r["phase"], fmt_bytes(r["peak_max"], unit)]
        + [fmt_bytes(r["steady_max"], unit), fmt_num(r["ratio"]), fmt_num(r["weights_only_ratio"])]
        for r in swaps
    ]
    if with_run:
        head, rows = ["run", *head], [[r["run"], *row] for r, row in zip(swaps, rows, strict=True)]
    return (
        '<p class="muted small">peak/steady = phase peak / bytes in use at the end of the phase, max over '
        "devices (steady includes the KV cache); weights-only = (peak - non-weight bytes) / weight bytes: "
        "1.0 is one copy, 2.0 two full copies.</p>" + _table(head, rows, ("run", "phase"))
    )


def plan_check_html(an: RunAnalysis) -> str:
    """Each phase's device bytes at its end: PREDICTED by the run's plan.json, MEASURED by its record."""
    from mllm_rl.memplan.audit import drifts

    check, unit = an.plan_check or {}, an.unit
    drifted = {r["phase"] for r in drifts(check)}
    phases = check.get("phases", [])
    flags = ["flag" if r["phase"] in drifted else "" for r in phases]
    head = ["phase", "resident at end", f"predicted {unit[1]}", f"measured {unit[1]}", "measured/predicted"]
    rows = [
        [r["phase"], ", ".join(r["resident_at_end"]), fmt_bytes(r["predicted"], unit)]
        + [
            fmt_bytes(r["measured"], unit),
            fmt_num(r["measured"] / r["predicted"] if r["predicted"] else None),
        ]
        for r in phases
    ]
    return (
        f'<p class="muted small">PREDICTED: the plan the run made before start-up (target '
        f"{escape(str(check.get('target')))}); MEASURED: the device's bytes in use at the end of each phase "
        f"(the last step, and setup). A phase above the prediction by more than {check.get('tolerance', 0):.0%} "
        "is a finding.</p>\n" + _table(head, rows, ("phase", "resident at end"), classes=flags)
    )


def run_section(an: RunAnalysis, heading: bool) -> str:
    out = [f"<h2>Run {escape(an.run.label)}</h2>" if heading else "<h2>Run</h2>", meta_html(an)]
    out += ["<h3>Memory per phase per device</h3>", memory_per_phase_charts(an)]
    out += ["<h3>Memory over time</h3>", memory_over_time_charts(an)]
    out += ["<h3>Host RSS over time</h3>", host_over_time_chart(an)]
    if an.plan_check:
        out += ["<h3>Memory plan vs run</h3>", plan_check_html(an)]
    out += ["<h3>Offload efficiency</h3>", efficiency_html(an)]
    if an.swaps:
        out += ["<h3>Weight swap: peak / steady</h3>", swap_html(an.swaps, an.unit)]
    if an.metrics:
        out += ["<h3>RL metrics per step</h3>", metric_charts(an)]
    out += ["<h3>Phases</h3>", phase_table_html(an)]
    return "\n".join(out)


def compare_html(analyses: Sequence[RunAnalysis], rows: list[dict[str, Any]]) -> str:
    unit = max((an.unit for an in analyses), key=lambda u: u[0])
    runs = []
    for an in analyses:
        s = an.summary()
        peaks = [r["peak_bytes"] for r in an.phases if r["peak_bytes"] is not None]
        ratios = [r["ratio"] for r in an.swaps if r["ratio"] is not None]
        runs.append(
            [an.run.label, s["backend"], _opt(s["plan"]), len(s["processes"]), s["records"]]
            + [fmt_num(s["wall_seconds"], 2), fmt_bytes(max(peaks, default=None), unit)]
            + [fmt_num(max(ratios, default=None)), count(an.issues)[ERROR]]
        )
    head = ["run", "backend", "plan", "processes", "records", "wall s", f"max phase peak {unit[1]}"]
    out = ["<h2>Comparison</h2>", _table([*head, "peak/steady", "errors"], runs, ("run", "backend", "plan"))]
    swaps = [r for an in analyses for r in an.swaps]
    if swaps:
        out += ["<h3>Weight swap: peak / steady per run</h3>", swap_html(swaps, unit, with_run=True)]
    out += ["<h3>Same phase, side by side</h3>", compare_charts(analyses, rows, unit)]
    cols = ("s", f"after {unit[1]}", f"peak {unit[1]}")
    head = ["phase"] + [f"{an.run.label} {k}" for an in analyses for k in cols]

    def side(v: dict[str, Any]) -> list[str]:
        secs = fmt_seconds(v.get("seconds"))
        return [secs, fmt_bytes(v.get("after_bytes"), unit), fmt_bytes(v.get("peak_bytes"), unit)]

    cells = [[r["phase"], *(x for v in r["runs"] for x in side(v or {}))] for r in rows]
    out.append(_table(head, cells, ("phase",), wrap=True))
    out.append(
        '<p class="muted small">Per phase: seconds of the slowest process; bytes summed over every device of '
        "every process.</p>"
    )
    return "\n".join(out)


def render(
    analyses: Sequence[RunAnalysis], issues: list[Issue], comparison: list[dict[str, Any]] | None
) -> str:
    title = f"mllm_rl memory report: {', '.join(an.run.label for an in analyses)}"
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="muted small">Generated {time.strftime("%Y-%m-%d %H:%M:%S")} by '
        "<code>python -m mllm_rl.report</code>; <code>-</code> = not measurable (never 0). "
        "Timeline: <code>trace.json</code> in ui.perfetto.dev. Hover a bar or point for its value.</p>",
        issues_html(issues, analyses),
    ]
    if comparison is not None:
        body.append(compare_html(analyses, comparison))
    body += [run_section(an, heading=len(analyses) > 1) for an in analyses]
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>'
        f"<style>{CSS}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )

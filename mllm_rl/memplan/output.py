"""What ``python -m mllm_rl.memplan`` prints and writes: text tables, ``plan.json``, ``plan.html``."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from mllm_rl.memplan.compose import GIB, SCHEMA, Plan, fmt, format_table, unit_for
from mllm_rl.memplan.request import Measured
from mllm_rl.text_table import aligned


def format_components(m: Measured) -> str:
    unit, scale = unit_for(max((c.bytes_per_device for c in m.components.values()), default=0))
    rows = [["component", unit, "method", "detail"]]
    for c in m.components.values():
        rows.append([c.name, fmt(c.bytes_per_device, scale), c.method, c.detail])
    return "\n".join(["Components (per device):", *aligned(rows, free_last=True)])


def format_functions(m: Measured) -> str:
    unit, scale = unit_for(max((f.peak_bytes for f in m.functions.values()), default=0))
    rows = [
        ["function", "method", "peak", "args", "outputs", "temp", "aliased", "extra", "compile s", "note"]
    ]
    sizes = ("peak_bytes", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes", "extra_bytes")
    for f in m.functions.values():
        secs = f"{f.compile_seconds:.1f}" if f.compile_seconds is not None else "-"
        note = f"REJECTED: {f.rejected}" if f.rejected else f.detail
        rows.append([f.name, f.method, *(fmt(getattr(f, b), scale) for b in sizes), secs, note])
    return "\n".join(
        [
            f"Functions ({m.target.platform} compiler unless the method says otherwise, {unit} per device; "
            "extra = peak - args):",
            *aligned(rows, free_last=True),
        ]
    )


def verdict(plan: Plan) -> str:
    over = plan.first_overflow()
    if over is None:
        unit, scale = unit_for(plan.peak.total)
        return f"{plan.schedule}: fits, peak {fmt(plan.peak.total, scale)} {unit} in {plan.peak.phase}"
    phase, comp = over
    return f"{plan.schedule}: DOES NOT FIT: {comp} overflows in {phase}"


def render(plans: dict[str, Plan], m: Measured, summary: list[str]) -> str:
    """Each schedule's table (the run's first), components, functions, notes and ``summary``."""
    parts = [("for comparison: " if i else "") + format_table(p) for i, p in enumerate(plans.values())]
    parts += [format_components(m), format_functions(m)]
    if m.notes:
        parts.append("Notes:\n" + "\n".join(f"- {n}" for n in m.notes))
    parts.append("\n".join(summary))
    return "\n\n".join(parts) + "\n"


def document(
    plans: dict[str, Plan], m: Measured, summary: list[str], extra: dict[str, Any]
) -> dict[str, Any]:
    """``plan.json``: every schedule's plan, the backend's facts, ``extra`` (the fit search)."""
    return {
        "schema": SCHEMA,
        "kind": "predicted",
        "schedule": next(iter(plans)),
        "plans": {s: p.to_json() for s, p in plans.items()},
        "info": m.info,
        "summary": summary,
        **extra,
    }


def write(out: Path, text: str, doc: dict[str, Any]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    files = [out / "plan.txt", out / "plan.json", out / "plan.html"]
    files[0].write_text(text)
    files[1].write_text(json.dumps(doc, indent=2, default=str) + "\n")
    files[2].write_text(to_html(doc))
    return files


_COLORS = {
    "engine_weights": "#4e79a7",
    "kv_pool": "#a0cbe8",
    "trainer_params": "#f28e2b",
    "optimizer": "#ffbe7d",
    "grads": "#59a14f",
    "ref_params": "#8cd17d",
    "staging": "#b6992d",
    "blas_workspaces": "#79706e",
    "temp": "#e15759",
}


def to_html(doc: dict[str, Any]) -> str:
    """A self-contained page: per schedule, a bar per phase stacked by component, against the budget."""
    esc = html.escape
    body = ["<h1>PREDICTED memory plan</h1>"]
    for sched, p in doc["plans"].items():
        t, hbm, budget = p["target"], p["target"]["hbm_bytes"], p["budget_bytes"]
        scale = 600 / max(hbm, max(ph["total"] for ph in p["phases"]))
        body.append(
            f"<h2>{esc(sched)}: {esc(t['name'])} ({t['num_devices']} x {esc(t['device_kind'])}, "
            f"{hbm / GIB:.2f} GiB per device from {esc(t['source'])}; budget {p['margin']:.0%})</h2>"
        )
        body.append("<table><tr><th>phase</th><th>GiB</th><th></th></tr>")
        for ph in p["phases"]:
            segs = [
                *ph["resident"].items(),
                *([("temp", ph["function_extra"])] if ph["function_extra"] else []),
            ]
            bars = "".join(
                f'<span title="{esc(k)} {v / GIB:.2f} GiB" style="display:inline-block;height:14px;'
                f'width:{v * scale:.1f}px;background:{_COLORS.get(k, "#999")}"></span>'
                for k, v in segs
            )
            over = ' style="color:#c00"' if ph["total"] > budget else ""
            body.append(
                f"<tr{over}><td>{esc(ph['phase'])}</td><td>{ph['total'] / GIB:.2f}</td>"
                f'<td style="position:relative">{bars}<span style="position:absolute;left:{budget * scale:.0f}px;'
                f'top:0;height:14px;border-left:2px dashed #000"></span></td></tr>'
            )
        body.append("</table>")
        body.append(
            f"<p>{'fits' if p['fits'] else 'DOES NOT FIT: ' + esc(' in '.join(reversed(p['first_overflow'])))}</p>"
        )
    legend = " ".join(
        f'<span style="background:{c};padding:0 6px">{esc(k)}</span>' for k, c in _COLORS.items()
    )
    body.append(f"<p>{legend} (dashed line: budget)</p>")
    body.append("<pre>" + esc("\n".join(doc.get("summary", []))) + "</pre>")
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>memory plan</title>"
        "<style>body{font-family:sans-serif}td{padding:1px 6px;white-space:nowrap}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n"
    )

"""Param-swap benchmark: streaming vs naive, and the machine's copy bandwidth, side by side in one run.

    python -m mllm_rl.bench swap --backend jax|torch --preset qwen3-4b [--platform gpu] [--json OUT]
    python -m mllm_rl.bench swap --preset tiny -- --swap-chunk-mb 0      # extra flags for mllm_rl.run

Each in a fresh process, the checkpoint in the page cache: the copy-bandwidth baseline (``copy``,
``--copy-mb``), then ``mllm_rl.run --plan swap`` with ``--swap-mode streaming`` and ``naive``. Per
mode, from the ``weights_swapped`` record: ``peak/steady`` (target for streaming <= 1.10),
``weights-only`` = (peak - non-weight bytes) / weight bytes, ``GB/s`` and ``GB/s / H2D`` (target
>= 0.7 on an accelerator).

Exit 0 with the results (``--strict``: 1 when an applicable target fails), 2 on bad input,
1 when a run failed.
"""

from __future__ import annotations

import argparse
from typing import Any

from mllm_rl.bench import GiB, MiB
from mllm_rl.bench.child import BenchError, run_phases, warm_page_cache
from mllm_rl.bench.cli import bench_parser, csv_choice, main_with_child, output_flags, pick, positive, target
from mllm_rl.bench.copy_bandwidth import baseline
from mllm_rl.bench.machine import bench_json
from mllm_rl.bench.records import allocator, truth
from mllm_rl.bench.tables import table, target_lines

MODES = ("streaming", "naive")
PEAK_TARGET = 1.10
H2D_TARGET = 0.7


def _ratios(devs: list[dict[str, Any]], weights: int, tp: int) -> tuple[float | None, float | None]:
    per_dev_weights = weights / max(1, len(devs)) if tp > 1 else weights
    ratios, w_ratios = [], []
    for dev in devs:
        steady, peak = dev["bytes_in_use"], dev["phase_peak_bytes"]
        if steady and peak:
            ratios.append(peak / steady)
            w_ratios.append((peak - (steady - per_dev_weights)) / per_dev_weights)
    return (round(max(ratios), 4) if ratios else None, round(max(w_ratios), 4) if w_ratios else None)


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    records, err = run_phases(f"{mode} swap", args.timeout, args.extra, backend=args.backend, plan="swap",
        model=args.preset, tp=args.tp, platform=args.platform, swap_mode=mode, max_new_tokens=4)  # fmt: skip
    if err:
        raise BenchError(err)
    recs = {x["phase"]: x for x in records}
    sw = recs["weights_swapped"]
    devs = truth(sw["memory"]["devices"])
    weights = sw["info"]["bytes"]
    ratio, w_ratio = _ratios(devs, weights, args.tp)
    alloc_ratio, alloc_w = _ratios(allocator(sw["memory"]["devices"]), weights, args.tp)
    return {"mode": mode, "platform": devs[0]["platform"] if devs else None,
        "source": devs[0]["source"] if devs else None, "devices": len(devs),
        "engine": recs["engine_ready_dummy"]["info"].get("engine"), "weight_bytes": weights,
        "steady_bytes_max": max(d["bytes_in_use"] for d in devs),
        "peak_bytes_max": max(d["phase_peak_bytes"] for d in devs), "peak_over_steady": ratio,
        "weights_only_ratio": w_ratio,
        "allocator_peak_over_steady": alloc_ratio,  # torch CUDA: the allocator's view (no CUDA context)
        "allocator_weights_only_ratio": alloc_w, "swap_seconds": sw["info"]["seconds"], "gbps": sw["info"]["gbps"],
        "host_rss_peak_bytes": sw["memory"]["host"]["rss_peak_bytes"],
        "generated": recs["generate_result"]["info"].get("token_ids")}  # fmt: skip


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from mllm_rl.checkpoint.resolve import resolve_model

    model = resolve_model(args.preset)  # written once, before any timing
    cache = warm_page_cache(model.path)
    base = None if args.no_baseline else baseline(args.backend, model.nbytes, args.platform, args.repeats,
                                                   args.timeout, mb=args.copy_mb)  # fmt: skip
    rows = [run_mode(m, args) for m in args.modes]
    accel = bool(rows) and rows[0]["platform"] not in ("cpu", None)
    h2d = base["h2d"]["gbps_best"] if base else None
    pinned = (base or {}).get("h2d_pinned", {}).get("gbps_best")
    for r in rows:
        r["gbps_over_h2d"] = round(r["gbps"] / h2d, 4) if h2d else None
        r["gbps_over_h2d_pinned"] = round(r["gbps"] / pinned, 4) if pinned else None
    out: dict[str, Any] = bench_json("swap", args, ("backend", "preset", "tp"),
        checkpoint_bytes=model.nbytes, page_cache_warmup=cache, copy_baseline=base, rows=rows)  # fmt: skip
    by_mode = {r["mode"]: r for r in rows}
    if "streaming" in by_mode:
        s = by_mode["streaming"]
        why = "CPU: no host-to-device link; the swap's time is host-side casting and compilation"
        out["targets"] = {"streaming_peak_over_steady": target(s["peak_over_steady"], "<=", PEAK_TARGET),
            "streaming_gbps_over_h2d": target(s["gbps_over_h2d"], ">=", H2D_TARGET, applies=accel and h2d is not None,
                                              why=why if not accel else "no baseline measured")}  # fmt: skip
    gens = [r["generated"] for r in rows]
    out["outputs_identical"] = all(g == gens[0] for g in gens)  # greedy after each mode's swap
    if "naive" in by_mode and "streaming" in by_mode:
        out["naive_over_streaming_peak"] = round(by_mode["naive"]["peak_bytes_max"] / by_mode["streaming"]["peak_bytes_max"], 4)  # fmt: skip
    return out


def report(out: dict[str, Any]) -> str:
    cols = [("mode", "mode", ""), ("peak_over_steady", "peak/steady", ".3f"),
        ("weights_only_ratio", "weights-only", ".3f"), ("peak_gib", "peak GiB", ".3f"),
        ("steady_gib", "steady GiB", ".3f"), ("gbps", "GB/s", ".3f"),
        ("gbps_over_h2d", "GB/s / H2D", ".3f"), ("src", "source", "")]  # fmt: skip
    rows = [{**r, "peak_gib": r["peak_bytes_max"] / GiB, "steady_gib": r["steady_bytes_max"] / GiB,
             "src": f"{r['platform']}/{r['source']}"} for r in out["rows"]]  # fmt: skip
    lines = [f"swap {out['backend']} {out['preset']} (tp {out['tp']}, checkpoint {out['checkpoint_bytes'] / GiB:.3f} GiB)",
             table(rows, cols)]  # fmt: skip
    if b := out["copy_baseline"]:
        parts = [
            f"{k} {b[k]['gbps_best']:.3f}"
            for k in ("h2d", "h2d_pinned", "d2h", "d2d")
            if "gbps_best" in b.get(k, {})
        ]
        lines.append(f"copy baseline ({b['runtime']} {b['platform']}, {b['bytes'] / MiB:.0f} MiB, best GB/s): "
                     + ", ".join(parts) + (f"  [{b['note']}]" if "note" in b else ""))  # fmt: skip
    if "naive_over_streaming_peak" in out:
        lines.append(f"naive/streaming peak: {out['naive_over_streaming_peak']:.3f}")
    lines.append(f"greedy output identical across modes: {out['outputs_identical']}")
    lines += target_lines(out.get("targets", {}))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    # fmt: off
    ap.add_argument("--tp", type=positive(int), default=1)
    ap.add_argument("--modes", type=csv_choice(MODES), default=list(MODES), help="comma-separated")
    ap.add_argument("--copy-mb", type=positive(float), default=None,
                    help="copy-baseline buffer, MiB (default: checkpoint size clamped to [64, 4096])")
    ap.add_argument("--repeats", type=positive(int), default=5, help="timed copies per baseline (best is used)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the copy baseline")
    ap.add_argument("--strict", action="store_true", help="exit 1 when an applicable target fails")
    # fmt: on
    output_flags(ap, per="subprocess", extra="extra args for mllm_rl.run (after --)")
    args = ap.parse_args(argv)
    keys = ("bench", "backend", "preset", "targets")
    return main_with_child(args, None, bench, report, lambda o: pick(o, keys), strict=args.strict)

"""RL step memory: the multi-stage schedule vs the naive one, side by side in one run.

    python -m mllm_rl.bench rl-memory --backend jax|torch --preset tiny [--budget-gb 0.05] [--json OUT]
    python -m mllm_rl.bench rl-memory --backend torch --preset qwen3-1.7b --platform cuda --bisect
    python -m mllm_rl.bench rl-memory --preset tiny -- --prompts-per-step 4   # extra flags for mllm_rl.run

One ``mllm_rl.run --plan rl`` per ``--schedule`` in a fresh process; from its phase records (max
over devices and steps): per-phase peaks, the step and setup peaks, step peak / max(train_step,
rollout), and the largest KV cache that fits ``--budget-gb`` (default the device's
``bytes_limit``), predicted (only the KV pool grows with ``--max-total-tokens``) or, with
``--bisect``, measured by growing it until an out-of-memory.

Exit 0 with results, 1 when a run failed, 2 on bad input.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from mllm_rl.bench import GiB, MiB
from mllm_rl.bench.child import BenchError, is_oom, run_phases
from mllm_rl.bench.cli import bench_parser, csv_choice, output_flags, pick, positive, progress, run_bench
from mllm_rl.bench.machine import bench_json
from mllm_rl.bench.records import max_of, truth
from mllm_rl.bench.tables import merge_orders, table

SCHEDULES = ("multi_stage", "naive")
PRE_ENGINE = ("wandb_init", "jax_ready", "torch_ready")
ENTRY_KEYS = ("step_peak", "step_peak_phase", "setup_peak", "setup_peak_phase", "train_peak", "rollout_peak")


# -- one run -------------------------------------------------------------------------------
def run_once(args: argparse.Namespace, schedule: str, max_total_tokens: int | None = None) -> dict[str, Any]:
    """One RL run; returns {"ok", "oom", "records", "stderr"} (failures are data for the bisect)."""
    records, err = run_phases(f"rl {schedule}", args.timeout, args.extra, backend=args.backend, plan="rl",
        model=args.preset, platform=args.platform, schedule=schedule, steps=args.steps, save_every=0,
        max_total_tokens=max_total_tokens)  # fmt: skip
    return {"ok": not err, "oom": bool(err) and is_oom(err), "records": records, "stderr": err}


def analyse(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-phase peaks, KV residency, step/setup peaks and KV bytes of one run's records."""
    phases: dict[str, dict[str, Any]] = {}
    kv_prev, seen_engine, seen_step = False, False, False
    kv_bytes = tokens = limit = None
    count: dict[tuple[int | None, str], int] = {}
    for r in records:
        devs = truth(r["memory"]["devices"])
        name = r["phase"]
        if name == "engine_ready_dummy":
            seen_engine = True
            tokens = r["info"].get("max_total_tokens")
        eng = r["info"].get("engine") if isinstance(r["info"].get("engine"), dict) else None
        kv_end = ("kv_cache" not in eng["released"]) if eng else (seen_engine and name not in PRE_ENGINE)
        held = r["info"].get("held")
        if isinstance(held, dict) and "kv_cache" in held:
            kv_bytes = held["kv_cache"]
        limit = max_of([limit, *[d.get("bytes_limit") for d in devs]])
        step = r["step"]
        seen_step = seen_step or step is not None
        # once-per-run phases are kept apart from the steps' phases of the same name (the setup runs
        # release_rollout, offload_optimizer, resume_kv, ... too): "setup:NAME" before the first step,
        # "end:NAME" after the last
        base = name if step is not None else (f"end:{name}" if seen_step else f"setup:{name}")
        k = count[(step, base)] = count.get((step, base), 0) + 1
        key = base if k == 1 else f"{base}#{k}"
        p = phases.setdefault(key, {"phase": key, "stepped": step is not None, "peak": None, "end": None,
                                    "kv": False, "n": 0, "host_rss_peak": None})  # fmt: skip
        p["peak"] = max_of([p["peak"], *[d.get("phase_peak_bytes") for d in devs]])
        p["end"] = max_of([p["end"], max_of([d.get("bytes_in_use") for d in devs])])
        p["kv"] = p["kv"] or kv_prev or kv_end
        # host RSS peak: on CPU it also sees what the device probes cannot (XLA temporaries, autograd)
        p["host_rss_peak"] = max_of([p["host_rss_peak"], r["memory"]["host"].get("rss_peak_bytes")])
        p["n"] += 1
        kv_prev = kv_end
    stepped = [p for p in phases.values() if p["stepped"]]
    setup = [p for p in phases.values() if not p["stepped"]]
    return {"phases": list(phases.values()), "step_peak": max_of([p["peak"] for p in stepped]),
        "step_peak_phase": max(stepped, key=lambda p: p["peak"] or 0)["phase"] if stepped else None,
        "setup_peak": max_of([p["peak"] for p in setup]),
        "setup_peak_phase": max(setup, key=lambda p: p["peak"] or 0)["phase"] if setup else None,
        "train_peak": phases.get("train_step", {}).get("peak"),
        "rollout_peak": phases.get("rollout", {}).get("peak"), "kv_bytes": kv_bytes,
        "max_total_tokens": tokens,
        "kv_bytes_per_token": kv_bytes / tokens if kv_bytes and tokens else None, "bytes_limit": limit,
        "source": truth(records[-1]["memory"]["devices"])[0]["source"] if records else None,
        "platform": truth(records[-1]["memory"]["devices"])[0]["platform"] if records else None}  # fmt: skip


def predict_kv(a: dict[str, Any], budget: int, steps_only: bool) -> dict[str, Any]:
    """Largest KV cache (bytes, tokens) for which every phase fits ``budget`` (see the docstring)."""
    kv = a["kv_bytes"] or 0
    cap = math.inf
    limiting = None
    for p in a["phases"]:
        if p["peak"] is None or (steps_only and not p["stepped"]):
            continue
        non_kv = p["peak"] - (kv if p["kv"] else 0)
        if p["kv"]:
            if budget - non_kv < cap:
                cap, limiting = budget - non_kv, p["phase"]
        elif non_kv > budget:
            return {"kv_bytes": 0, "tokens": 0, "limiting_phase": p["phase"],
                "note": "does not fit even without KV"}  # fmt: skip
    if cap is math.inf:
        return {"kv_bytes": None, "tokens": None, "limiting_phase": None,
            "note": "no phase holds the KV cache"}  # fmt: skip
    cap = max(0, int(cap))
    per_tok = a["kv_bytes_per_token"]
    return {"kv_bytes": cap, "tokens": int(cap // per_tok) if per_tok else None, "limiting_phase": limiting}


# -- bisect --------------------------------------------------------------------------------
def bisect(args: argparse.Namespace, schedule: str, lo: int, guess: int | None) -> dict[str, Any]:
    """Largest --max-total-tokens with which the run succeeds; ``lo`` is known to succeed."""
    align = args.bisect_align
    trials: list[dict[str, Any]] = []

    def attempt(tokens: int) -> bool:
        r = run_once(args, schedule, tokens)
        a = analyse(r["records"]) if r["records"] else {}
        trials.append({"max_total_tokens": tokens, **pick(r, ("ok", "oom")),
                       **{k: a.get(k) for k in ("kv_bytes", "step_peak", "setup_peak")}})  # fmt: skip
        progress(f"  bisect {schedule}: --max-total-tokens {tokens}: {'ok' if r['ok'] else 'OOM' if r['oom'] else 'FAILED'}")  # fmt: skip
        if not r["ok"] and not r["oom"]:
            raise BenchError(f"bisect {schedule} at {tokens} tokens failed without an OOM:\n{r['stderr'][-2000:]}")  # fmt: skip
        return r["ok"]

    hi = max(lo * 2, ((guess or 0) * 5 // 4) // align * align)
    iters = 0
    while iters < args.bisect_iters and attempt(hi):  # grow until a failure
        lo, hi, iters = hi, hi * 2, iters + 1
    while iters < args.bisect_iters and (hi - lo) > max(align, lo * args.bisect_tol):
        mid = (lo + hi) // 2 // align * align
        if mid <= lo:
            break
        if attempt(mid):
            lo = mid
        else:
            hi = mid
        iters += 1
    return {"largest_ok_tokens": lo,
        "smallest_oom_tokens": hi if any(not t["ok"] for t in trials) else None, "trials": trials}  # fmt: skip


# -- driver --------------------------------------------------------------------------------
def bench(args: argparse.Namespace) -> dict[str, Any]:
    from mllm_rl.checkpoint.resolve import resolve_model

    resolve_model(args.preset)  # written once, outside every run's timing
    runs: dict[str, dict[str, Any]] = {}
    for s in args.schedules:
        r = run_once(args, s)
        if not r["ok"]:
            raise BenchError(r["stderr"])
        runs[s] = analyse(r["records"])
    any_run = next(iter(runs.values()))
    budget = int(args.budget_gb * GiB) if args.budget_gb else any_run["bytes_limit"]
    out: dict[str, Any] = bench_json("rl_memory", args, ("backend", "preset", "steps"),
        extra=list(args.extra), platform=any_run["platform"], source=any_run["source"],
        budget_bytes=budget,
        budget_from="--budget-gb" if args.budget_gb else ("bytes_limit" if budget else None),
        schedules={})  # fmt: skip
    for s, a in runs.items():
        big = max_of([a["train_peak"], a["rollout_peak"]])
        entry = pick(a, [*ENTRY_KEYS, "kv_bytes", "max_total_tokens", "kv_bytes_per_token", "bytes_limit"])
        entry["step_peak_over_max_train_rollout"] = (
            round(a["step_peak"] / big, 4) if big and a["step_peak"] else None
        )
        entry["phases"] = a["phases"]
        if budget:
            entry["fit_steps"] = predict_kv(a, budget, steps_only=True)
            entry["fit_run"] = predict_kv(a, budget, steps_only=False)
        out["schedules"][s] = entry
    if args.bisect:
        for s, a in runs.items():
            guess = out["schedules"][s].get("fit_run", {}).get("tokens")
            out["schedules"][s]["bisect"] = bisect(args, s, a["max_total_tokens"], guess)
    if "multi_stage" in runs and "naive" in runs:
        ms, nv = runs["multi_stage"]["step_peak"], runs["naive"]["step_peak"]
        out["naive_over_multi_stage_step_peak"] = round(nv / ms, 4) if ms and nv else None
        out["step_peak_saved_bytes"] = nv - ms if ms is not None and nv is not None else None
    return out


def report(out: dict[str, Any]) -> str:
    scheds = list(out["schedules"])
    names = merge_orders([[p["phase"] for p in out["schedules"][s]["phases"]] for s in scheds])
    by = {s: {p["phase"]: p for p in out["schedules"][s]["phases"]} for s in scheds}
    mib = lambda x: None if x is None else x / MiB  # noqa: E731
    rows = []
    for n in names:
        row: dict[str, Any] = {"phase": n}
        for s in scheds:
            p = by[s].get(n)
            row[s] = mib(p["peak"]) if p else None
            row[s + "_kv"] = ("kv" if p["kv"] else "") if p else None
        rows.append(row)
    cols = [("phase", "phase", "")]
    for s in scheds:
        cols += [(s, f"{s} peak MiB", ".2f"), (s + "_kv", "", "")]
    lines = [
        f"rl memory {out['backend']} {out['preset']} ({out['platform']}/{out['source']}, {out['steps']} steps, "
        f"max over steps and devices; 'kv' = KV cache resident in the phase)",
        table(rows, cols),
        "",
    ]
    srows = [{"schedule": s, "step": mib(e["step_peak"]), "at": e["step_peak_phase"], "setup": mib(e["setup_peak"]),
        "sat": e["setup_peak_phase"], "ratio": e["step_peak_over_max_train_rollout"], "kv": (e["kv_bytes"] or 0) / MiB,
        "fs": (e.get("fit_steps") or {}).get("tokens"), "fr": (e.get("fit_run") or {}).get("tokens"),
        "bis": (e.get("bisect") or {}).get("largest_ok_tokens")} for s, e in out["schedules"].items()]  # fmt: skip
    budget = out["budget_bytes"]
    cols2 = [("schedule", "schedule", ""), ("step", "step peak MiB", ".2f"), ("at", "at", ""),
        ("setup", "setup+final peak MiB", ".2f"), ("sat", "at", ""),
        ("ratio", "step/max(train,rollout)", ".3f"), ("kv", "KV MiB", ".2f"),
        ("fs", "max KV tokens (steps)", ""), ("fr", "max KV tokens (run)", ""),
        ("bis", "bisected tokens", "")]  # fmt: skip
    lines.append(table(srows, cols2))
    if "naive_over_multi_stage_step_peak" in out:
        lines.append(f"naive / multi_stage step peak: {out['naive_over_multi_stage_step_peak']}  "
                     f"(saved {out['step_peak_saved_bytes'] / MiB:.2f} MiB)")  # fmt: skip
    if budget:
        lines.append(
            f"max KV tokens: predicted for a budget of {budget / GiB:.3f} GiB ({out['budget_from']}) from "
            "the measured per-phase bytes (only the KV pool grows with --max-total-tokens)"
        )
    else:
        lines.append("max KV tokens: no budget (CPU has no device limit): pass --budget-gb to predict it")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__)
    # fmt: off
    ap.add_argument("--steps", type=positive(int), default=2, help="RL steps per run (>= 2 catches step-2 faults)")
    ap.add_argument("--schedules", type=csv_choice(SCHEDULES), default=list(SCHEDULES), help="comma-separated")
    ap.add_argument("--budget-gb", type=positive(float), default=None,
                    help="device budget (GiB) for the predicted largest KV cache (default: the device's bytes_limit)")
    ap.add_argument("--bisect", action="store_true", help="measure the largest --max-total-tokens by OOM bisection")
    ap.add_argument("--bisect-iters", type=positive(int), default=8, help="runs per schedule at most")
    ap.add_argument("--bisect-tol", type=positive(float), default=0.05, help="stop when (hi - lo) / lo is below")
    ap.add_argument("--bisect-align", type=positive(int), default=256, help="token granularity")
    # fmt: on
    output_flags(ap, extra="extra args for mllm_rl.run (after --), the same for every run")
    keys = ("bench", "backend", "preset", "naive_over_multi_stage_step_peak")
    return run_bench(bench, ap.parse_args(argv), report, lambda o: pick(o, keys))[0]

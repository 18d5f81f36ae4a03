"""The memory plans of the TPU/GPU acceptance cases, one after another, in one table.

    python -m mllm_rl.bench plan-targets [--cases 4b-v4-8,8b-v5p-8] [--out runs/plans] [--json OUT]

Every case is one ``python -m mllm_rl.memplan`` (its command is in the table's JSON and in
docs/PLAN.md); everything is PREDICTED by the target's compiler (libtpu / XLA GPU) and the
engine's layout formulas, compile-only on this machine. Reported per case: each schedule's
verdict and peak (per device, against the device memory), the KV pool and the
``mem_fraction_static`` it needs, the compile time and the planner's host memory (its peak RSS)
and wall time.

Exit 0 when every case whose expectation is "fits" fits (multi_stage) and every plan ran; 1
otherwise; 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from mllm_rl.bench import GiB
from mllm_rl.bench.child import child_env
from mllm_rl.bench.cli import csv_choice, progress, run_bench
from mllm_rl.bench.machine import bench_json
from mllm_rl.bench.tables import table
from mllm_rl.memplan.__main__ import EXIT_DOES_NOT_FIT, EXIT_OK

BATCH = ["--micro-batch-size", "4", "--seq-len", "4096", "--group-size", "8", "--prompts-per-step", "8"]
KV128K = ["--kv-tokens", "131072"]
# The trainer's memory-lean paths for GPU targets: ModelOptions.for_platform's stacked layers,
# per-block remat and 256-position head chunks (the default everywhere) with chunked attention
# (splash is a TPU kernel; off TPU the default attention is dense).
GPU_LEAN = [
    "--model-option",
    "scan_layers=true",
    "--model-option",
    "remat=block",
    "--model-option",
    "attention=chunked",
    "--model-option",
    "logprob_chunk=256",
]
FIT_SEQ = ["--micro-batch-size", "1", "--seq-len", "8192", "--fit", "seq_len", "--fit-step", "4096"]
MLLM_JAX_ENGINE = [
    "--micro-batch-size",
    "1",
    "--seq-len",
    "1024",
    "--kv-tokens",
    "4096",
    "--max-running-requests",
    "16",
]


def _case(model: str, target: str, tp: int, *extra: str, expect: str = "report") -> tuple[list[str], str]:
    return ["--model", model, "--target", target, "--tp", str(tp), *extra], expect


# name: (plan arguments, expectation for multi_stage: "fits" | "report")
CASES: dict[str, tuple[list[str], str]] = {
    "4b-v4-8": _case("qwen3-4b", "v4-8", 4, *BATCH, *KV128K, expect="fits"),
    "4b-v4-8-fit-kv": _case("qwen3-4b", "v4-8", 4, *BATCH, "--fit", "kv", expect="fits"),
    "4b-v4-8-fit-seq": _case("qwen3-4b", "v4-8", 4, *FIT_SEQ, expect="fits"),
    # MLLM-JAX's v4-8 run of sglang-jax with Qwen3-4B (tp 4, bf16, max_total_tokens 4096,
    # max_running_requests 16): engine weights + KV pool after the weight swap, before any generate
    "4b-v4-8-engine": _case("qwen3-4b", "v4-8", 4, *MLLM_JAX_ENGINE, expect="fits"),
    # Qwen3-8B full fine-tune at the mixed-precision default on one v4-8: float32 masters and AdamW
    # moments; the moments on the device do not fit, in host memory (streamed by the update) they do
    "8b-v4-8": _case("qwen3-8b", "v4-8", 4, *BATCH, *KV128K),
    "8b-v4-8-host-opt": _case(
        "qwen3-8b", "v4-8", 4, *BATCH, *KV128K, "--model-option", "optimizer_memory=host", expect="fits"
    ),
    "8b-v4-16": _case("qwen3-8b", "v4-16", 8, *BATCH, *KV128K),
    "8b-v5p-8": _case("qwen3-8b", "v5p-8", 4, *BATCH, *KV128K),
    "4b-v5e-8": _case("qwen3-4b", "v5e-8", 8, *BATCH, *KV128K),
    "4b-h100x1": _case("qwen3-4b", "h100x1", 1, *BATCH, *KV128K, *GPU_LEAN),
    "4b-h100x8": _case("qwen3-4b", "h100x8", 8, *BATCH, *KV128K, *GPU_LEAN),
    # 8 rows split over the 8 devices (4 rows cannot be: each device computes all 4)
    "4b-h100x8-mb8": _case("qwen3-4b", "h100x8", 8, *BATCH, "--micro-batch-size", "8", *KV128K, *GPU_LEAN),
}


# Measured elsewhere, to hold a plan against: (case, phase of the plan, bytes summed over devices, source).
REFERENCES = {
    "4b-v4-8-engine": (
        "setup:continue_generation",
        8652005376,
        "demon2036/MLLM-JAX docs/sops/tpu-sglang-jax-qwen3-4b-wandb-memory-logging.md, v4-8 run A: "
        "bytes_in_use_sum after weights_swapped",
    )
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--cases", type=csv_choice(list(CASES)), default=list(CASES), help="comma-separated")
    ap.add_argument(
        "--out", type=Path, default=Path("runs/plans"), help="each case's plan.json/txt/html in OUT/CASE"
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per plan")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    return ap.parse_args(argv)


def _case(name: str, out: Path, timeout: float) -> dict[str, Any]:
    import subprocess

    args, expect = CASES[name]
    cmd = [sys.executable, "-m", "mllm_rl.memplan", *args, "--out", str(out / name)]
    progress(f"[bench] {name}: python {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"case": name, "command": "python " + " ".join(cmd[1:]), "rc": r.returncode,
        "expect": expect, "wall_s": wall}  # fmt: skip
    if r.returncode not in (EXIT_OK, EXIT_DOES_NOT_FIT):
        row["error"] = (r.stderr.strip().splitlines() or ["?"])[-1]
        return row
    doc = json.loads((out / name / "plan.json").read_text())
    info = doc["info"]
    for sched, p in doc["plans"].items():
        peak = max(p["phases"], key=lambda ph: ph["total"])
        over = [ph["phase"] for ph in p["phases"] if ph["total"] > p["budget_bytes"]]
        row[sched] = {"fits": p["fits"], "peak_gib": peak["total"] / GiB, "peak_phase": peak["phase"],
            "peak_of_hbm": peak["total"] / p["target"]["hbm_bytes"], "over": over,
            "first_overflow": p["first_overflow"]}  # fmt: skip
    t = doc["plans"]["multi_stage"]["target"]
    if name in REFERENCES:
        phase, measured, source = REFERENCES[name]
        ph = next(p for p in doc["plans"]["multi_stage"]["phases"] if p["phase"] == phase)
        predicted = ph["total"] * t["num_devices"]
        row["reference"] = {"phase": phase, "predicted_sum": predicted, "measured_sum": measured,
            "ratio": predicted / measured, "within_2pct": abs(predicted / measured - 1) <= 0.02,
            "source": source, "resident": ph["resident"]}  # fmt: skip
    row.update(
        target=t["name"],
        devices=t["num_devices"],
        hosts=t["num_hosts"],
        hbm_gib=t["hbm_bytes"] / GiB,
        kv_tokens=info.get("kv_tokens"),
        mem_fraction_static=info.get("mem_fraction_static"),
        compile_s=sum(info.get("compile_seconds", {}).values()),
        host_rss_gib=info.get("host_peak_rss_bytes", 0) / GiB,
        summary=doc["summary"],
        fit=doc.get("fit", {}).get("value"),
    )
    return row


def bench(args: argparse.Namespace) -> dict[str, Any]:
    rows = [_case(name, args.out, args.timeout) for name in args.cases]
    ok = all("error" not in r and (r["expect"] != "fits" or r["multi_stage"]["fits"]) for r in rows)
    ok = ok and all(r["reference"]["within_2pct"] for r in rows if "reference" in r)
    return bench_json("plan_targets", args, rows=rows, ok=ok)


def _flat(r: dict[str, Any]) -> dict[str, Any]:
    if "error" in r:
        return {"case": r["case"], "ms": "ERROR: " + r["error"]}
    ms, nv = r["multi_stage"], r["naive"]

    def verdict(p: dict[str, Any]) -> str:
        if p["fits"]:
            return f"fits {p['peak_gib']:.2f} ({p['peak_of_hbm']:.0%}) {p['peak_phase']}"
        return f"OVER in {', '.join(dict.fromkeys(p['over']))}"

    return {"case": r["case"], "target": f"{r['target']} ({r['devices']}x{r['hbm_gib']:.2f} GiB)",
        "ms": verdict(ms), "naive": verdict(nv), "kv": r["kv_tokens"], "frac": r["mem_fraction_static"],
        "fit": r["fit"], "compile": r["compile_s"], "rss": r["host_rss_gib"], "wall": r["wall_s"]}  # fmt: skip


def report(out: dict[str, Any]) -> str:
    cols = [("case", "case", ""), ("target", "target", ""),
        ("ms", "multi_stage (GiB/device, of HBM, at)", ""), ("naive", "naive", ""), ("kv", "KV tokens", ""),
        ("frac", "mem_fraction_static", ""), ("fit", "fitted", ""), ("compile", "compile s", ".0f"),
        ("rss", "host RSS GiB", ".2f"), ("wall", "wall s", ".0f")]  # fmt: skip
    lines = [
        "PREDICTED (compile-only; libtpu / XLA GPU on this machine):",
        table([_flat(r) for r in out["rows"]], cols),
    ]
    for r in out["rows"]:
        if "reference" in r:
            ref, n = r["reference"], r["devices"]
            lines.append(
                f"{r['case']}: {ref['phase']} PREDICTED {ref['predicted_sum'] / GiB:.3f} GiB over {n} devices "
                f"({ref['predicted_sum'] / n / GiB:.3f} per device) vs MEASURED {ref['measured_sum'] / GiB:.3f} "
                f"GiB ({ref['source']}): ratio {ref['ratio']:.4f}"
            )
    return "\n".join(lines)


def summary(out: dict[str, Any]) -> dict[str, Any]:
    return {"bench": "plan_targets", "ok": out["ok"],
        "cases": {r["case"]: r.get("multi_stage", {}).get("fits", r.get("error")) for r in out["rows"]}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, out = run_bench(bench, args, report, summary)
    if out is not None and not out["ok"]:
        return 1
    return code

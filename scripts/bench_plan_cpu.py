#!/usr/bin/env python
"""Predicted vs measured on CPU: the memory plan of a run, made for the run's own CPU device,
held against that run's phase records.

    python scripts/bench_plan_cpu.py --model tiny --steps 2 [--run-dir DIR] [--json OUT]

1. runs ``python -m mllm_rl.run --backend jax --platform cpu`` (unless ``--run-dir`` already
   holds a finished run), then reads its ``run.json`` and ``phases.jsonl``;
2. runs ``python -m mllm_rl.memplan --backend jax --target cpu`` with the run's knobs (model,
   micro-batch, KV pool tokens, group size, prompts, LoRA, KL, schedule; sequence length = the
   engine's context length, the longest a training row can be);
3. compares (``mllm_rl.memplan.audit``): per component (engine weights, KV pool, trainer
   params, optimizer) and per phase (bytes in use at the end of each phase of the last step and
   of setup) within ``--tolerance``; prints the grad step's compiled temporaries next to the
   host-RSS rise the run measured in ``train_step``.

Exit 0 when every comparison is within the tolerance, 1 when one is not, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mllm_rl.bench import GiB, MiB
from mllm_rl.bench.child import BenchError, run_cmd
from mllm_rl.bench.cli import positive, run_bench
from mllm_rl.bench.machine import command_line, machine_info
from mllm_rl.bench.tables import table
from mllm_rl.memplan.audit import compare, load_records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--model", default="tiny", help="preset or checkpoint dir (the run's --model)")
    ap.add_argument("--steps", type=positive(), default=2, help="RL steps of the run")
    ap.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="reuse (or write) the run here (default: runs/plan-cpu-MODEL)",
    )
    ap.add_argument("--tolerance", type=float, default=0.05, help="allowed |predicted / measured - 1|")
    ap.add_argument(
        "--run-arg", action="append", default=[], help="extra argument for mllm_rl.run (repeatable)"
    )
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    args = ap.parse_args(argv)
    if not 0 < args.tolerance < 1:
        ap.error(f"--tolerance must be in (0, 1), got {args.tolerance}")
    return args


def _run(args: argparse.Namespace, run_dir: Path) -> None:
    if (run_dir / "phases.jsonl").exists() and (run_dir / "run.json").exists():
        return
    cmd = [
        sys.executable,
        "-m",
        "mllm_rl.run",
        "--backend",
        "jax",
        "--platform",
        "cpu",
        "--model",
        args.model,
        "--steps",
        str(args.steps),
        "--wandb",
        "disabled",
        "--console",
        "off",
        "--run-dir",
        str(run_dir),
        *args.run_arg,
    ]
    run_cmd(cmd, "the RL run", timeout=3600)


def plan_command(run: dict[str, Any], records: list[dict[str, Any]], out: Path) -> list[str]:
    """The plan command for the run described by ``run.json`` and its ``engine_ready_dummy``."""
    eng = next((r["info"] for r in records if r["phase"] == "engine_ready_dummy"), None)
    if eng is None:
        raise BenchError("the run has no engine_ready_dummy record")
    train = run["train"]
    cmd = [
        sys.executable,
        "-m",
        "mllm_rl.memplan",
        "--backend",
        "jax",
        "--target",
        "cpu",
        "--model",
        run["model"],
        "--micro-batch-size",
        str(train["micro_batch_size"]),
        "--seq-len",
        str(eng["context_length"]),
        "--kv-tokens",
        str(eng["max_total_tokens"]),
        "--tp",
        str(eng["tp"]),
        "--max-running-requests",
        str(eng["max_running_requests"]),
        "--group-size",
        str(run["group_size"]),
        "--prompts-per-step",
        str(run["prompts_per_step"]),
        "--lora-rank",
        str(train["lora_rank"]),
        "--kl-beta",
        str(train["loss"]["beta"]),
        "--schedule",
        run["schedule"],
        "--out",
        str(out),
    ]
    return cmd


def bench(args: argparse.Namespace) -> dict[str, Any]:
    run_dir = args.run_dir or Path("runs") / f"plan-cpu-{Path(args.model).name}"
    _run(args, run_dir)
    records = load_records(run_dir)
    run = json.loads((run_dir / "run.json").read_text())
    plan_dir = run_dir / "plan"
    cmd = plan_command(run, records, plan_dir)
    r = run_cmd(cmd, "the plan")
    doc = json.loads((plan_dir / "plan.json").read_text())
    result = compare(records, doc, args.tolerance)
    return {
        "bench": "plan_cpu",
        "command": command_line(),
        "run_dir": str(run_dir),
        "plan_command": " ".join(cmd[1:]),
        "plan_summary": doc["summary"],
        "plan_stderr_tail": r.stderr[-500:],
        "machine": machine_info(),
        **result,
    }


def report(out: dict[str, Any]) -> str:
    mib = lambda b: None if b is None else b / MiB  # noqa: E731
    comps = [dict(r, predicted=mib(r["predicted"]), measured=mib(r["measured"])) for r in out["components"]]
    phases = [
        dict(
            r,
            predicted=mib(r["predicted"]),
            measured=mib(r["measured"]),
            before=mib(r["measured_before"]),
            during=mib(r["predicted_during"]),
        )
        for r in out["phases"]
    ]
    g = out["grad_step"]
    rss = ", ".join(f"step {x['step']}: {x['rss_rise'] / MiB:.1f} MiB" for x in g["measured_rss_rise"])
    cols = [
        ("predicted", "predicted MiB (plan)", ".2f"),
        ("measured", "measured MiB (run)", ".2f"),
        ("ratio", "ratio", ".3f"),
        ("within", f"within {out['tolerance']:.0%}", ""),
    ]
    return "\n".join(
        [
            f"run: {out['run_dir']}   plan: python {out['plan_command']}",
            "",
            "Components (PREDICTED by the plan for the cpu target vs MEASURED by the run's own byte counts):",
            table(comps, [("component", "component", "")] + cols),
            "",
            "Bytes in use at the end of each phase (setup, then the last step; PREDICTED vs MEASURED live arrays;"
            " a step's phase holds when the last step or the one before is within):",
            table(
                phases,
                [("phase", "phase", "")]
                + cols[:3]
                + [("before", "measured MiB (step before)", ".2f"), cols[3]]
                + [
                    ("during", "plan's peak during the phase MiB", ".2f"),
                    ("below_during", "measured <= it", ""),
                ],
            ),
            "",
            f"grad_step compiled temporaries (PREDICTED, XLA:CPU): {g['temp_bytes'] / MiB:.1f} MiB; "
            f"measured host-RSS rise in train_step: {rss}",
            "",
            "within tolerance: " + ("yes" if out["within"] else "NO"),
        ]
    )


def summary(out: dict[str, Any]) -> dict[str, Any]:
    worst = max(
        (abs(r["ratio"] - 1) for r in out["components"] + out["phases"] if r["ratio"] is not None),
        default=None,
    )
    return {
        "bench": "plan_cpu",
        "within": out["within"],
        "worst_deviation": worst,
        "run_dir": out["run_dir"],
        "grad_temp_gib": (out["grad_step"]["temp_bytes"] or 0) / GiB,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    code, out = run_bench(bench, args, report, summary)
    if out is not None and not out["within"]:
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())

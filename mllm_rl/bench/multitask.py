"""Several tasks on the same devices vs each task alone, side by side in one run.

    python -m mllm_rl.bench multitask --backend jax|torch [--tasks 2] [--steps 2] [--json OUT]

Every task alone, then all in one ``mllm_rl.run --tasks FILE`` (tiny, seeds 0..N-1, different
learning rates), each in a fresh process. Targets: multi-task peak / largest single peak <= 1.05;
drift of device bytes between leases <= 1 MiB; wall time / sum of the singles' <= 1.10; each
task's per-step rewards, losses and grad norms exactly as alone.

Exit 0 when every target passed, 1 when one failed or a run failed, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mllm_rl.bench import MiB
from mllm_rl.bench.child import flags, run_argv, run_cmd
from mllm_rl.bench.cli import failed_targets, main_with_child, positive, progress, target
from mllm_rl.bench.machine import command_line, load_avg_1m, machine_info
from mllm_rl.bench.records import max_of, truth
from mllm_rl.bench.tables import table
from mllm_rl.sinks.jsonl import read_jsonl

# Enough samples that the tiny model earns non-zero rewards on both backends (equal zeros prove nothing).
SETTINGS = {"steps": 2, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 8, "max_running_requests": 64,
            "checkpoint_every": 0}  # fmt: skip
LRS = (3e-3, 1e-3, 2e-3, 5e-4)
RUN_LEVEL = ("wandb_init", "jax_ready", "torch_ready")


def task_list(n: int) -> list[dict[str, Any]]:
    return [{"name": f"t{i}", "model": "tiny", "seed": i, "lr": LRS[i % len(LRS)]} for i in range(n)]


def tasks_toml(tasks: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    lines = ["[defaults]", *(f"{k} = {v}" for k, v in settings.items())]
    for t in tasks:
        lines += ["", "[[task]]", *(f"{k} = {json.dumps(v)}" for k, v in t.items())]
    return "\n".join(lines) + "\n"


def _device_peak(run_dir: Path) -> int | None:
    recs = read_jsonl(run_dir / "phases.jsonl")
    return max_of([sum(d["phase_peak_bytes"] or 0 for d in truth(r["memory"]["devices"])) for r in recs])


def _phase_seconds(run_dir: Path, task: str | None = None) -> float:
    """Seconds spent in a task's phases (the run-level ``wandb_init``/``*_ready`` left out)."""
    recs = read_jsonl(run_dir / "phases.jsonl")
    mine = [r for r in recs if r["phase"] not in RUN_LEVEL and task in (None, r.get("task"))]
    return sum(r["t_end"] - r["t_start"] for r in mine)


def _rewards(run_dir: Path, task: str | None = None) -> list[list[float]]:
    """``[reward_mean, loss, grad_norm]`` per step."""
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if task in (None, r.get("task"))]
    return [[r["reward_mean"], r["loss"], r["grad_norm"]] for r in sorted(rows, key=lambda r: r["step"])]


def _timed(cmd: list[str], what: str, env: dict[str, str], load: list[float]) -> float:
    """Seconds ``cmd`` ran; the load average after it appended to ``load``."""
    t0 = time.perf_counter()
    run_cmd(cmd, what, timeout=3600, env=env)
    load.append(load_avg_1m())
    return time.perf_counter() - t0


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from mllm_rl.checkpoint.resolve import resolve_model

    settings = {**SETTINGS, "steps": args.steps}
    tasks = task_list(args.tasks)
    load = [load_avg_1m()]
    with tempfile.TemporaryDirectory() as d:
        base = args.keep or Path(d)
        base.mkdir(parents=True, exist_ok=True)
        env = {"MLLM_RL_CACHE": str(base / "cache"), "WANDB_SILENT": "true"}
        os.environ["MLLM_RL_CACHE"] = env["MLLM_RL_CACHE"]
        for t in tasks:  # checkpoints written before anything is timed
            resolve_model(t["model"], seed=t["seed"])

        def cmd(run_dir: Path, *more: str) -> list[str]:
            return run_argv(run_dir, *more, backend=args.backend, platform=args.platform)

        singles = []
        for t in tasks:
            run_dir = base / f"single_{t['name']}"
            progress(f"single task {t['name']} ...")
            more = flags(model=t["model"], seed=t["seed"], lr=t["lr"], **settings)
            wall = _timed(cmd(run_dir, *more), f"single task {t['name']}", env, load)
            singles.append({"run": f"alone: {t['name']}", "wall_s": wall, "peak_bytes": _device_peak(run_dir),
                            "rewards": _rewards(run_dir), "phase_s": _phase_seconds(run_dir)})  # fmt: skip
        toml = base / "tasks.toml"
        toml.write_text(tasks_toml(tasks, settings))
        run_dir = base / "multi"
        progress(f"{len(tasks)} tasks together ...")
        wall = _timed(cmd(run_dir, "--tasks", str(toml)), "multi-task run", env, load)
        from mllm_rl.multitask.driver import read_leases

        leases = read_leases(run_dir / "leases.jsonl")
        n_setup = sum(x["kind"] == "setup" for x in leases)
        baseline = leases[n_setup - 1]["device_bytes"]
        drift = max_of(
            [abs(x["device_bytes"] - baseline) for x in leases[n_setup:] if x["device_bytes"] is not None]
        )
        multi = {"run": f"{len(tasks)} tasks together", "wall_s": wall,
            "peak_bytes": _device_peak(run_dir),
            "rewards": {t["name"]: _rewards(run_dir, t["name"]) for t in tasks}, "leases": len(leases),
            "baseline_bytes": baseline, "max_drift_bytes": drift,
            "phase_s": {t["name"]: _phase_seconds(run_dir, t["name"]) for t in tasks}}  # fmt: skip
    peak_single = max_of([s["peak_bytes"] for s in singles])
    equal = all(multi["rewards"][t["name"]] == s["rewards"] for t, s in zip(tasks, singles, strict=True))
    equal = equal and any(step[0] > 0 for s in singles for step in s["rewards"])  # not all zeros
    ratio_peak = multi["peak_bytes"] / peak_single if peak_single else None
    ratio_wall = wall / sum(s["wall_s"] for s in singles)
    return {"command": command_line(), "machine": machine_info(), "backend": args.backend, "tasks": tasks,
        "settings": settings, "load_avg_1m": load, "singles": singles, "multi": multi,
        "targets": {"peak_ratio": target(ratio_peak, "<=", 1.05),
            "between_leases_mib": target(drift / MiB if drift is not None else None, "<=", 1.0),
            "wall_ratio": target(ratio_wall, "<=", 1.10),
            "rewards_equal": {"value": equal, "target": "== alone, not all 0", "pass": equal}}}  # fmt: skip


def report(out: dict[str, Any]) -> str:
    m = out["multi"]
    rows = [
        {**r, "peak_mib": r["peak_bytes"] / MiB if r["peak_bytes"] is not None else None}
        for r in [*out["singles"], m]
    ]
    trows = [{"name": k, **v} for k, v in out["targets"].items()]
    per_task = ", ".join(f"{t['name']} {m['phase_s'][t['name']]:.1f} s together vs {s['phase_s']:.1f} s alone"
                         for t, s in zip(out["tasks"], out["singles"], strict=True))  # fmt: skip
    return "\n".join([
        table(rows, [("run", "run", ""), ("wall_s", "wall s", ".1f"), ("peak_mib", "device peak MiB", ".3f")]), "",
        table(trows, [("name", "target", ""), ("value", "measured", ".4g"), ("target", "bound", ""), ("pass", "pass", "")]),
        f"\ntime in each task's phases: {per_task}",
        f"baseline between leases {m['baseline_bytes']} B, max drift {m['max_drift_bytes']} B over "
        f"{m['leases']} leases; load average (1 min) before/after each run: {out['load_avg_1m']}"])  # fmt: skip


def summary(out: dict[str, Any]) -> dict[str, Any]:
    return {"bench": "multitask", "backend": out["backend"],
        **{k: v["value"] for k, v in out["targets"].items()}, "pass": not failed_targets(out)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # fmt: off
    ap.add_argument("--backend", required=True, choices=["jax", "torch"])
    ap.add_argument("--platform", default="cpu", choices=["auto", "cpu", "gpu", "tpu", "cuda"])
    ap.add_argument("--tasks", type=positive(int), default=2, help="number of tasks (tiny preset, seeds 0..N-1)")
    ap.add_argument("--steps", type=positive(int), default=2, help="RL steps per task")
    ap.add_argument("--json", type=Path, default=None, help="write every measurement here")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here (default: a temp dir)")
    # fmt: on
    args = ap.parse_args(argv)
    if args.tasks > len(LRS):
        print(f"error: --tasks {args.tasks}: at most {len(LRS)}", file=sys.stderr)
        return 2
    return main_with_child(args, None, bench, report, summary, strict=True)

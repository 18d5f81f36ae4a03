"""Memory plan vs a live run, side by side in one run (torch backend).

    python scripts/bench_plan_vs_live.py --preset tiny [--json OUT]
    python scripts/bench_plan_vs_live.py --preset qwen3-0.6b -- --prompts-per-step 2 --group-size 2
    python scripts/bench_plan_vs_live.py --plan-only --preset qwen3-4b --target h100 --micro-batch 1 --seq-len 1024

Cross-check (default): the torch planner's prediction (``backends/torch/memplan.py``) next to what a
real ``python -m mllm_rl.run --backend torch --platform cpu --steps 2`` measures (``live_tensors``:
params and optimizer state from its phase records; gradients from one real
``TorchTrainer.device_step`` in a fresh process). Target: params, gradients and optimizer state
within 1% of the measured bytes; the activation figure is printed beside the RSS rise of
``train_step``, a different quantity with no target.

``--plan-only``: the composed plan of ``--preset`` on ``--target`` for both schedules, per phase,
with each component's method and the planner's peak host RSS. Exit 0 ok, 1 a run failed or a
target missed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

from mllm_rl.bench import GiB, MiB
from mllm_rl.bench.child import BenchError, run_cmd
from mllm_rl.bench.cli import exit_code, failed_targets, positive, run_bench, target
from mllm_rl.bench.machine import command_line, machine_info
from mllm_rl.bench.records import truth
from mllm_rl.bench.tables import table

RUN_DEFAULTS = {
    "prompts_per_step": 16,
    "group_size": 8,
    "micro_batch_size": 64,
    "lora_rank": 0,
    "kl_beta": 0.0,
    "max_running_requests": 128,
}


def run_flags(extra: list[str]) -> dict[str, Any]:
    """The trainer-relevant ``mllm_rl.run`` flags among ``extra`` (the run's defaults otherwise)."""
    ap = argparse.ArgumentParser(add_help=False)
    for k, v in RUN_DEFAULTS.items():
        ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    return vars(ap.parse_known_args(extra)[0])


# -- the live run ----------------------------------------------------------------------------------
def live_run(args: argparse.Namespace, run_dir: str) -> dict[str, Any]:
    from mllm_rl.sinks.jsonl import read_jsonl

    cmd = [
        sys.executable,
        "-m",
        "mllm_rl.run",
        "--backend",
        "torch",
        "--plan",
        "rl",
        "--model",
        args.preset,
        "--platform",
        "cpu",
        "--steps",
        "2",
        "--save-every",
        "0",
        "--wandb",
        "disabled",
        "--quiet",
        "--run-dir",
        run_dir,
        *args.extra,
    ]
    run_cmd(cmd, "live run", timeout=args.timeout)
    records = read_jsonl(Path(run_dir) / "phases.jsonl")
    by = {}
    for r in records:
        if r["step"] is not None:
            by.setdefault(r["phase"], []).append(r)
    if "onload_trainer" not in by or "offload_optimizer" not in by or "train_step" not in by:
        raise BenchError(f"live run: no step phases in {run_dir}/phases.jsonl")

    def in_use(r: dict[str, Any]) -> int:
        devs = truth(r["memory"]["devices"])
        if not devs or devs[0]["source"] != "live_tensors":
            raise BenchError(f"live run: phase {r['phase']} has no live_tensors record")
        return int(devs[0]["bytes_in_use"])

    params = [in_use(r) for r in by["offload_optimizer"]]
    both = [in_use(r) for r in by["onload_trainer"]]
    rss = [
        r["memory"]["host"]["rss_peak_bytes"] - r["memory"]["host"]["rss_start_bytes"]
        for r in by["train_step"]
    ]
    model = next(r["info"]["model"] for r in records if r["phase"] == "engine_ready_dummy")
    return {
        "cmd": " ".join(cmd),
        "checkpoint": model,
        "params": params,
        "optimizer": [b - p for b, p in zip(both, params, strict=True)],
        "train_step_rss_rise": rss,
    }


def live_grads(args: argparse.Namespace, checkpoint: str, flags: dict[str, Any]) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "_grads",
        checkpoint,
        "--rows",
        str(rows(flags)),
        "--seq-len",
        str(args.seq_len),
        "--micro-batch",
        str(flags["micro_batch_size"]),
        "--lora-rank",
        str(flags["lora_rank"]),
        "--kl-beta",
        str(flags["kl_beta"]),
    ]
    r = run_cmd(cmd, "live gradients", timeout=args.timeout)
    return json.loads(r.stdout.strip().splitlines()[-1])


def grads_main(argv: list[str]) -> int:
    """``_grads CKPT``: one real train step on CPU; prints the bytes of the distinct gradient
    storages just before the optimizer step."""
    ap = argparse.ArgumentParser(prog="bench_plan_vs_live.py _grads")
    ap.add_argument("checkpoint")
    for k in ("rows", "seq_len", "micro_batch", "lora_rank"):
        ap.add_argument("--" + k.replace("_", "-"), type=int, required=True)
    ap.add_argument("--kl-beta", type=float, required=True)
    a = ap.parse_args(argv)
    from mllm_rl.backends.torch.memplan import step_batch
    from mllm_rl.backends.torch.trainer import TorchTrainer
    from mllm_rl.checkpoint.model_dir import ModelDir
    from mllm_rl.rl.loss_config import LossConfig
    from mllm_rl.trainer import TrainConfig

    md = ModelDir.open(a.checkpoint)
    cfg = TrainConfig(micro_batch_size=a.micro_batch, lora_rank=a.lora_rank, loss=LossConfig(beta=a.kl_beta))
    tr = TorchTrainer(md, cfg, device="cpu")
    seen: list[int] = []

    def pre_step(*_: Any) -> None:
        storages = {
            p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
            for p in tr.trainable.values()
            if p.grad is not None
        }
        seen.append(sum(storages.values()))

    tr.optimizer.register_step_pre_hook(pre_step)
    tr.device_step(step_batch(md.config, a.rows, a.seq_len))
    print(json.dumps({"grads": seen[-1]}))
    return 0


def rows(flags: dict[str, Any]) -> int:
    return flags["prompts_per_step"] * flags["group_size"]


# -- the plan --------------------------------------------------------------------------------------
def plan_request(args: argparse.Namespace, config: Any, flags: dict[str, Any], dtype: str) -> Any:
    from mllm_rl.memplan.request import PlanRequest

    return PlanRequest(
        "torch",
        args.target,
        config,
        micro_batch=flags["micro_batch_size"],
        seq_len=args.seq_len,
        prompts=flags["prompts_per_step"],
        group_size=flags["group_size"],
        lora_rank=flags["lora_rank"],
        kl=flags["kl_beta"] > 0,
        param_dtype=dtype,
        margin=args.margin,
        max_running_requests=flags["max_running_requests"],
    )


def model_of(preset: str) -> tuple[Any, str]:
    """(ModelConfig, param dtype name) of a preset or a checkpoint dir."""
    from mllm_rl.checkpoint.hf_config import config_from_dir
    from mllm_rl.presets import PRESETS

    c = PRESETS[preset] if preset in PRESETS else config_from_dir(Path(preset))
    return c, c.torch_dtype


def composed(plan: Any) -> dict[str, Any]:
    """One schedule's plan (``mllm_rl.memplan.planner.plans``: setup phases first) as JSON rows."""
    over = plan.first_overflow()
    rows_ = [
        {
            "phase": p.phase,
            "resident": dict(p.resident),
            "function": p.function,
            "function_extra": p.function_extra,
            "total": p.total,
        }
        for p in plan.phases
    ]
    return {
        "schedule": plan.schedule,
        "budget": plan.budget,
        "phases": rows_,
        "fits": plan.fits,
        "first_overflow": over,
        "peak_phase": plan.peak.phase,
        "peak": plan.peak.total,
    }


def plan_only(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import asdict

    from mllm_rl.backends.torch.memplan import measure
    from mllm_rl.memplan.planner import plans

    config, dtype = model_of(args.preset)
    flags = {
        **RUN_DEFAULTS,
        "prompts_per_step": args.prompts,
        "group_size": args.group_size,
        "micro_batch_size": args.micro_batch,
    }
    req = plan_request(args, config, flags, args.dtype or dtype)
    m = measure(req)
    comps = {k: asdict(v) for k, v in m.components.items()}
    return {
        "bench": "plan_vs_live",
        "mode": "plan_only",
        "kind": "predicted",
        "preset": args.preset,
        "target": asdict(m.target),
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "markdown": args.markdown,
        "components": comps,
        "info": m.info,
        "functions": {k: dict(asdict(v), extra_bytes=v.extra_bytes) for k, v in m.functions.items()},
        "plans": [dict(composed(p), components=comps, notes=m.notes) for p in plans(m, req).values()],
        "planner_host_rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "command": command_line(),
        "machine": machine_info(),
    }


def cross_check(args: argparse.Namespace) -> dict[str, Any]:
    from mllm_rl.backends.torch.memplan import measure

    flags = run_flags(args.extra)
    config, dtype = model_of(args.preset)
    with tempfile.TemporaryDirectory() as d:
        live = live_run(args, d)
    live["grads"] = live_grads(args, live["checkpoint"], flags)["grads"]
    m = measure(plan_request(args, config, flags, dtype))
    c, f = m.components, m.functions["grad_step"]
    pairs = {
        "params": (c["trainer_params"].bytes_per_device, max(live["params"])),
        "optimizer": (c["optimizer"].bytes_per_device, max(live["optimizer"])),
        "grads": (c["grads"].bytes_per_device, live["grads"]),
    }
    rows_ = [
        {"quantity": k, "plan": p, "live": v, "ratio": p / v if v else None} for k, (p, v) in pairs.items()
    ]
    targets = {
        f"{k}_within_1pct": target(abs(r["ratio"] - 1) if r["ratio"] else None, "<=", 0.01)
        for k, r in zip(pairs, rows_, strict=True)
    }
    return {
        "bench": "plan_vs_live",
        "mode": "cross_check",
        "preset": args.preset,
        "dtype": dtype,
        "batch": {"rows": rows(flags), "micro_batch": flags["micro_batch_size"], "seq_len": args.seq_len},
        "rows": rows_,
        "targets": targets,
        "plan_activations": f.temp_bytes,
        "plan_grad_step_extra": f.extra_bytes,
        "plan_grad_step_peak": f.peak_bytes,
        "plan_grads_plus_activations": c["grads"].bytes_per_device + f.temp_bytes,
        "live_train_step_rss_rise": live["train_step_rss_rise"],
        "live_cmd": live["cmd"],
        "plan_notes": m.notes,
        "command": command_line(),
        "machine": machine_info(),
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    return plan_only(args) if args.plan_only else cross_check(args)


# -- report ----------------------------------------------------------------------------------------
def report(out: dict[str, Any]) -> str:
    if out["mode"] == "plan_only":
        return report_plan(out)
    lines = [
        f"PLAN (predicted, fake tensors) vs LIVE (measured, CPU) - {out['preset']} {out['dtype']}, "
        f"{out['batch']['rows']} rows in micro-batches of {out['batch']['micro_batch']}, "
        f"T = {out['batch']['seq_len']}",
        table(
            out["rows"],
            [
                ("quantity", "bytes", ""),
                ("plan", "plan (fake_tensor)", ","),
                ("live", "live (live_tensors / real step)", ","),
                ("ratio", "plan / live", ".6f"),
            ],
        ),
        "",
        f"activations + temporaries at the step's peak (plan): {out['plan_activations'] / MiB:.1f} MiB; "
        f"+ gradients: {out['plan_grads_plus_activations'] / MiB:.1f} MiB",
        "host RSS rise of train_step (live, per step): "
        + ", ".join(f"{x / MiB:.1f} MiB" for x in out["live_train_step_rss_rise"]),
        "targets: " + ", ".join(f"{k} {'pass' if t['pass'] else 'FAIL'}" for k, t in out["targets"].items()),
    ]
    return "\n".join(lines)


def report_plan(out: dict[str, Any]) -> str:
    t = out["target"]
    lines = [
        f"PREDICTED (torch planner) - {out['preset']} on {t['name']} ({t['device_kind']}, "
        f"{t['hbm_bytes'] / GiB:.2f} GiB from {t['source']}); micro-batch {out['micro_batch']} x "
        f"{out['seq_len']}"
    ]
    lines += [
        f"  {k}: {v['bytes_per_device'] / GiB:.3f} GiB [{v['method']}] {v['detail']}"
        for k, v in out["components"].items()
        if k != "kv_pool"
    ]
    for k, v in out["functions"].items():
        lines.append(
            f"  {k}: peak {v['peak_bytes'] / GiB:.3f} GiB, extra {v['extra_bytes'] / GiB:.3f} GiB "
            f"[{v['method']}] {v['detail']}"
        )
    for p in out["plans"]:
        kv = p["components"]["kv_pool"]
        verdict = (
            f"fits: peak {p['peak'] / GiB:.2f} GiB in {p['peak_phase']}"
            if p["fits"]
            else f"DOES NOT FIT: {p['first_overflow'][1]} overflows in {p['first_overflow'][0]}"
        )
        lines += [
            "",
            f"{p['schedule']} (budget {p['budget'] / GiB:.2f} GiB): {verdict}; kv_pool "
            f"{kv['bytes_per_device'] / GiB:.3f} GiB [{kv['method']}] {kv['detail']}",
        ]
        lines.append(_markdown(p) if out["markdown"] else _text(p))
        lines += [f"- {n}" for n in p["notes"]]
    lines.append(f"planner host RSS peak: {out['planner_host_rss_peak'] / MiB:.0f} MiB")
    return "\n".join(lines)


def _text(p: dict[str, Any]) -> str:
    comps = p["components"]
    used = [k for k in comps if any(k in r["resident"] for r in p["phases"])]
    rows_ = []
    for r in p["phases"]:
        row = {"phase": r["phase"], "total": r["total"] / GiB, "measured": None}
        row.update({k: r["resident"][k] / GiB for k in used if k in r["resident"]})
        row["temp"] = r["function_extra"] / GiB if r["function"] else None
        row["over"] = "OVER" if r["total"] > p["budget"] else ""
        rows_.append(row)
    cols = [("phase", "phase", "")] + [(k, f"{k} [{comps[k]['method']}]", ".2f") for k in used]
    cols += [
        ("temp", "grad_step temp [fake_tensor]", ".2f"),
        ("total", "predicted GiB", ".2f"),
        ("measured", "measured GiB", ""),
        ("over", "", ""),
    ]
    return table(rows_, cols)


def _markdown(p: dict[str, Any]) -> str:
    """The plan of one schedule as a Markdown table (what docs/BENCHMARKS.md shows)."""
    comps = p["components"]
    out = [
        "| phase | resident, GiB per device [method] | + temporaries GiB [method] | predicted GiB | "
        "measured GiB (H100) |",
        "|---|---|---|---|---|",
    ]
    for r in p["phases"]:
        res = ", ".join(f"{k} {v / GiB:.2f} [{comps[k]['method']}]" for k, v in r["resident"].items()) or "-"
        temp = f"{r['function_extra'] / GiB:.2f} ({r['function']}) [fake_tensor]" if r["function"] else "-"
        mark = " **over**" if r["total"] > p["budget"] else ""
        out.append(f"| {r['phase']} | {res} | {temp} | {r['total'] / GiB:.2f}{mark} | |")
    return "\n".join(out)


def summary(out: dict[str, Any]) -> dict[str, Any]:
    if out["mode"] == "plan_only":
        return {
            "bench": "plan_vs_live",
            "mode": "plan_only",
            "preset": out["preset"],
            "fits": {p["schedule"]: p["fits"] for p in out["plans"]},
            "planner_host_rss_peak": out["planner_host_rss_peak"],
        }
    ratios = {r["quantity"]: r["ratio"] for r in out["rows"]}
    return {
        "bench": "plan_vs_live",
        "preset": out["preset"],
        "ratios": ratios,
        "targets_pass": not failed_targets(out),
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Details: docs/BENCHMARKS.md")
    ap.add_argument("--preset", default="tiny", help="preset name or checkpoint dir")
    ap.add_argument(
        "--seq-len",
        type=positive(int),
        default=32,
        help="tokens per row the trainer sees (default 32: the shipped task's rows, padded)",
    )
    ap.add_argument(
        "--target", default="h100", help="plan target (h100, h200); the components do not depend on it"
    )
    ap.add_argument("--margin", type=float, default=0.9, help="fraction of device memory a phase may use")
    ap.add_argument("--plan-only", action="store_true", help="only the plan (no live run), both schedules")
    ap.add_argument("--micro-batch", type=positive(int), default=4, help="--plan-only: rows per micro-batch")
    ap.add_argument("--prompts", type=positive(int), default=8, help="--plan-only: prompts per step")
    ap.add_argument("--group-size", type=positive(int), default=8, help="--plan-only: completions per prompt")
    ap.add_argument("--dtype", default=None, help="--plan-only: param dtype (default: the preset's)")
    ap.add_argument("--markdown", action="store_true", help="--plan-only: the per-phase tables in Markdown")
    ap.add_argument("--timeout", type=positive(float), default=1800.0, help="seconds per subprocess")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("extra", nargs="*", help="extra args for mllm_rl.run (after --)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_grads"]:
        return grads_main(argv[1:])
    args = build_parser().parse_args(argv)
    if not 0 < args.margin <= 1:
        print(f"error: --margin {args.margin}: expected 0 < margin <= 1", file=sys.stderr)
        return 2
    code, out = run_bench(bench, args, report, summary)
    return exit_code(code, out)


if __name__ == "__main__":
    sys.exit(main())

"""Predicted vs measured on CPU: the memory plan of a run held against what that run measured.

    python -m mllm_rl.bench plan-vs-run --backend jax --model tiny --steps 2 [--run-dir DIR] [--json OUT]
    python -m mllm_rl.bench plan-vs-run --backend torch --preset tiny [--json OUT]
    python -m mllm_rl.bench plan-vs-run --backend torch --preset qwen3-0.6b -- --prompts-per-step 2 \\
        --group-size 2
    python -m mllm_rl.bench plan-vs-run --backend torch --plan-only --preset qwen3-4b --target h100 \\
        --micro-batch 1 --seq-len 1024 [--markdown]

Both backends: run ``python -m mllm_rl.run --backend B --platform cpu`` (unless ``--run-dir``
holds a finished run; flags after ``--`` or in ``--run-arg`` go to it), read its ``run.json`` and
``phases.jsonl``, plan the same run with ``python -m mllm_rl.memplan`` and the run's knobs (model,
micro-batch, KV pool tokens, group size, prompts, LoRA, KL, precision, schedule), compare.

jax (tolerance 5%): the plan for the run's own ``cpu`` target, sequence length = the engine's
context length, compared by ``mllm_rl.memplan.audit``: per component (engine weights, KV pool,
trainer params, optimizer) and per phase (bytes in use at the end of each phase of the last step
and of setup); the grad step's compiled temporaries beside the host-RSS rise of ``train_step``.

torch (tolerance 1%): the plan for ``--target`` (fake tensors; the compared figures do not depend
on it) at ``--seq-len``: trainer params and optimizer state against the run's ``live_tensors``
records, gradients against one real ``TorchTrainer.device_step`` in a fresh process; the plan's
activations beside the RSS rise of ``train_step`` (a different quantity, no target).
``--plan-only`` (no run): the composed plan of ``--preset`` on ``--target`` for both schedules,
per phase, with each component's method and the planner's peak host RSS.

Exit 0 every comparison within the tolerance, 1 one is not or a run failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path
from typing import Any

from mllm_rl.bench import GiB, MiB
from mllm_rl.bench.child import BenchError, bench_argv, run_cmd, run_json
from mllm_rl.bench.cli import doc_parser, failed_targets, main_with_child, positive, target
from mllm_rl.bench.machine import bench_json
from mllm_rl.bench.records import truth
from mllm_rl.bench.tables import table
from mllm_rl.memplan.audit import compare, load_records

# Per backend: the default tolerance and plan target, and the run's own flags (torch's comparison
# reads no checkpoint phase, and a real model's checkpoint costs GBs of disk; JAX's compares it).
BACKENDS = {
    "jax": {"tolerance": 0.05, "target": "cpu", "run_flags": []},
    "torch": {"tolerance": 0.01, "target": "h100", "run_flags": ["--save-every", "0"]},
}
# torch's flags and their defaults (parsed as None: a jax comparison refuses them when given)
TORCH_ONLY = dict(seq_len=32, plan_only=False, micro_batch=4, prompts=8, group_size=8, margin=0.9)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, with each backend's defaults filled in (exit 2 and one line on a bad one)."""
    ap = doc_parser(__doc__)
    ap.add_argument("--backend", required=True, choices=sorted(BACKENDS), help="whose run and planner")
    ap.add_argument("--model", "--preset", dest="model", default="tiny", help="preset or checkpoint dir")
    ap.add_argument("--steps", type=positive(), default=2, help="RL steps of the run (default 2)")
    ap.add_argument("--run-dir", type=Path, help="reuse (or write) the run here (runs/plan-B-cpu-MODEL)")
    ap.add_argument("--tolerance", type=float, help="|predicted / measured - 1| allowed (jax .05, torch .01)")
    ap.add_argument("--target", help="torch: the plan's target (default h100; jax plans the run's own cpu)")
    ap.add_argument("--seq-len", type=positive(), help="torch: tokens per trained row (32: the task's)")
    ap.add_argument("--plan-only", action="store_true", default=None, help="torch: the plan alone, no run")
    ap.add_argument("--micro-batch", type=positive(), help="--plan-only: rows per micro-batch (default 4)")
    ap.add_argument("--prompts", type=positive(), help="--plan-only: prompts per step (default 8)")
    ap.add_argument("--group-size", type=positive(), help="--plan-only: completions per prompt (default 8)")
    ap.add_argument("--dtype", help="--plan-only: param dtype (default: the preset's)")
    ap.add_argument(
        "--margin", type=float, help="--plan-only: fraction of device memory a phase may use (0.9)"
    )
    ap.add_argument("--markdown", action="store_true", help="--plan-only: the per-phase tables in Markdown")
    ap.add_argument("--timeout", type=positive(float), default=3600.0, help="seconds per subprocess")
    ap.add_argument("--run-arg", action="append", default=[], help="an argument for mllm_rl.run (repeatable)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("extra", nargs="*", help="more arguments for mllm_rl.run (after --)")
    args = ap.parse_args(argv)
    spec = BACKENDS[args.backend]
    torch_only = [k for k in (*TORCH_ONLY, "dtype", "markdown") if getattr(args, k) not in (None, False)]
    if args.backend == "jax" and (torch_only or args.target not in (None, "cpu")):
        ap.error(f"--{(torch_only or ['target'])[0].replace('_', '-')}: torch only (jax plans the run's cpu)")
    for k, v in TORCH_ONLY.items():
        setattr(args, k, v if getattr(args, k) is None else getattr(args, k))
    args.tolerance = spec["tolerance"] if args.tolerance is None else args.tolerance
    args.target = args.target or spec["target"]
    args.run_args = [*spec["run_flags"], *args.run_arg, *args.extra]
    if not 0 < args.tolerance < 1:
        ap.error(f"--tolerance must be in (0, 1), got {args.tolerance}")
    if not 0 < args.margin <= 1:
        ap.error(f"--margin {args.margin}: expected 0 < margin <= 1")
    return args


def results(args: argparse.Namespace, mode: str, **fields: Any) -> dict[str, Any]:
    """The JSON of either mode: what ran, then ``fields``."""
    return bench_json("plan_vs_run", args, ("backend",), mode=mode, preset=args.model, **fields)


# -- the run, its plan, the comparison (both backends) ----------------------------------------------
def the_run(args: argparse.Namespace) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    """The run's directory, ``run.json`` and phase records; runs it first unless it has finished."""
    run_dir = (args.run_dir or Path("runs") / f"plan-{args.backend}-cpu-{Path(args.model).name}").resolve()
    if not ((run_dir / "phases.jsonl").exists() and (run_dir / "run.json").exists()):
        cmd = [sys.executable, "-m", "mllm_rl.run", "--backend", args.backend, "--platform", "cpu", "--model",
               args.model, "--steps", str(args.steps), "--wandb", "disabled", "--console", "off"]  # fmt: skip
        run_cmd([*cmd, "--run-dir", str(run_dir), *args.run_args], "the RL run", timeout=args.timeout)
    run = json.loads((run_dir / "run.json").read_text())
    if run.get("backend") != args.backend:
        raise ValueError(f"--run-dir {run_dir}: a {run.get('backend')} run, not --backend {args.backend}")
    return run_dir, run, load_records(run_dir)


def plan_flags(args: argparse.Namespace, run: dict[str, Any], records: list[dict[str, Any]]) -> list[str]:
    """``mllm_rl.memplan`` flags with the run's knobs (``run.json``, its ``engine_ready_dummy``)."""
    eng = next((r["info"] for r in records if r["phase"] == "engine_ready_dummy"), None)
    if eng is None:
        raise BenchError("the run has no engine_ready_dummy record")
    train = run["train"]
    flags = {
        "--backend": args.backend,
        "--target": args.target,
        "--model": run["model"],
        "--micro-batch-size": train["micro_batch_size"],
        # jax: the longest a training row can be (what the run compiles); torch: the rows it trains
        "--seq-len": eng["context_length"] if args.backend == "jax" else args.seq_len,
        "--kv-tokens": eng["max_total_tokens"],
        "--tp": eng["tp"],
        "--max-running-requests": eng["max_running_requests"],
        "--group-size": run["group_size"],
        "--prompts-per-step": run["prompts_per_step"],
        "--lora-rank": train["lora_rank"],
        "--kl-beta": train["loss"]["beta"],
        "--precision": train["precision"],
        "--schedule": run["schedule"],
    }
    return [str(x) for kv in flags.items() for x in kv]


def bench(args: argparse.Namespace) -> dict[str, Any]:
    if args.plan_only:
        return plan_only(args)
    run_dir, run, records = the_run(args)
    cmd = [sys.executable, "-m", "mllm_rl.memplan", *plan_flags(args, run, records)]
    r = run_cmd([*cmd, "--out", str(run_dir / "plan")], "the plan", timeout=args.timeout)
    doc = json.loads((run_dir / "plan" / "plan.json").read_text())
    check = jax_check if args.backend == "jax" else torch_check
    return results(args, "cross_check", run_dir=str(run_dir), plan_command=" ".join(r.args[1:]),
                   plan_summary=doc["summary"], plan_stderr_tail=r.stderr[-500:],
                   **check(args, run_dir, run, records, doc))  # fmt: skip


def jax_check(args: argparse.Namespace, run_dir: Path, run: dict[str, Any], records: list[dict[str, Any]],
              doc: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """``mllm_rl.memplan.audit.compare``: components, and the bytes at the end of every phase."""
    out = compare(records, doc, args.tolerance)
    ratios = [r["ratio"] for r in out["components"] + out["phases"] if r["ratio"] is not None]
    worst = max((abs(x - 1) for x in ratios), default=None)
    why = f"<= {args.tolerance} (a step's phase: in the last step or the one before)"
    out["targets"] = {"within_tolerance": {"value": worst, "target": why, "pass": out["within"]}}
    return out


# -- torch: the trainer's live tensors and one real step's gradients ------------------------------
def torch_check(args: argparse.Namespace, run_dir: Path, run: dict[str, Any], records: list[dict[str, Any]],
                doc: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Params and optimizer state the run held (``live_tensors`` at the end of ``offload_optimizer``
    and ``onload_trainer``) and one real step's gradients, against the plan's."""
    by: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r["step"] is not None:
            by.setdefault(r["phase"], []).append(r)
    if not {"onload_trainer", "offload_optimizer", "train_step"} <= set(by):
        raise BenchError(f"the run has no step phases in {run_dir}/phases.jsonl")

    def in_use(r: dict[str, Any]) -> int:
        devs = truth(r["memory"]["devices"])
        if not devs or devs[0]["source"] != "live_tensors":
            raise BenchError(f"the run's phase {r['phase']} has no live_tensors record")
        return int(devs[0]["bytes_in_use"])

    params = [in_use(r) for r in by["offload_optimizer"]]
    both = [in_use(r) for r in by["onload_trainer"]]
    child = bench_argv("plan-vs-run", "--backend", "torch", "--child")
    child += ["--run-dir", str(run_dir), "--seq-len", str(args.seq_len)]
    grads = run_json(child, "live gradients", timeout=args.timeout)
    live = {
        "params": max(params),
        "optimizer": max(b - p for b, p in zip(both, params, strict=True)),
        "grads": grads["grads"],
    }
    plan = doc["plans"][doc["schedule"]]
    c, f = plan["components"], plan["functions"]["grad_step"]
    rows, targets = [], {}
    for k, v in live.items():
        p = c["trainer_params" if k == "params" else k]["bytes_per_device"]
        rows.append({"quantity": k, "plan": p, "live": v, "ratio": p / v if v else None})
        off = abs(p / v - 1) if v else None
        targets[f"{k}_within_{round(args.tolerance * 100, 6):g}pct"] = target(off, "<=", args.tolerance)
    host = [r["memory"]["host"] for r in by["train_step"]]
    return {
        "dtype": plan["inputs"]["param_dtype"],
        "batch": {
            "rows": rows_of(run),
            "micro_batch": run["train"]["micro_batch_size"],
            "seq_len": args.seq_len,
        },  # fmt: skip
        "rows": rows,
        "targets": targets,
        "plan_activations": f["temp_bytes"],
        "plan_grad_step_extra": f["extra_bytes"],
        "plan_grad_step_peak": f["peak_bytes"],
        "plan_grads_plus_activations": c["grads"]["bytes_per_device"] + f["temp_bytes"],
        "live_train_step_rss_rise": [h["rss_peak_bytes"] - h["rss_start_bytes"] for h in host],
        "plan_notes": plan["notes"],
    }


def rows_of(run: dict[str, Any]) -> int:
    """The rows of one step: prompts x completions."""
    return run["prompts_per_step"] * run["group_size"]


def live_grads(args: argparse.Namespace) -> dict[str, Any]:
    """``--child``: one real train step of the run's model, settings and batch on CPU; the bytes of
    the distinct gradient storages just before the optimizer step (no phase record holds them)."""
    from mllm_rl.backends.torch.memplan import step_batch
    from mllm_rl.backends.torch.trainer import TorchTrainer
    from mllm_rl.checkpoint.model_dir import ModelDir
    from mllm_rl.rl.loss_config import LossConfig
    from mllm_rl.trainer import TrainConfig

    run = json.loads((args.run_dir / "run.json").read_text())
    train, md = run["train"], ModelDir.open(run["model"])
    cfg = TrainConfig(micro_batch_size=train["micro_batch_size"], lora_rank=train["lora_rank"],
                      precision=train["precision"], loss=LossConfig(beta=train["loss"]["beta"]))  # fmt: skip
    tr = TorchTrainer(md, cfg, device="cpu")
    seen: list[int] = []

    def pre_step(*_: Any) -> None:
        grads = [p.grad.untyped_storage() for p in tr.trainable.values() if p.grad is not None]
        seen.append(sum({s.data_ptr(): s.nbytes() for s in grads}.values()))

    tr.optimizer.register_step_pre_hook(pre_step)
    tr.device_step(step_batch(md.config, rows_of(run), args.seq_len))
    return {"grads": seen[-1]}


# -- torch: the plan alone -------------------------------------------------------------------------
def plan_only(args: argparse.Namespace) -> dict[str, Any]:
    """The torch planner's plans of ``--preset`` on ``--target``, both schedules, in this process."""
    from mllm_rl.backends.torch.memplan import measure
    from mllm_rl.memplan.__main__ import load_model
    from mllm_rl.memplan.planner import plans
    from mllm_rl.memplan.request import PlanRequest

    config = load_model(args.model)
    req = PlanRequest("torch", args.target, config, micro_batch=args.micro_batch, seq_len=args.seq_len,
                      prompts=args.prompts, group_size=args.group_size, margin=args.margin,
                      param_dtype=args.dtype or config.torch_dtype)  # fmt: skip
    m = measure(req)
    composed = [p.to_json() for p in plans(m, req).values()]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return results(args, "plan_only", kind="predicted", micro_batch=args.micro_batch, seq_len=args.seq_len,
                   markdown=args.markdown, info=m.info, plans=composed,
                   planner_host_rss_peak=rss)  # fmt: skip


# -- reports ---------------------------------------------------------------------------------------
def report(out: dict[str, Any]) -> str:
    if out["mode"] == "plan_only":
        return report_plan(out)
    head = f"run: {out['run_dir']}   plan: python {out['plan_command']}\n\n"
    return head + (report_jax(out) if out["backend"] == "jax" else report_torch(out))


def report_jax(out: dict[str, Any]) -> str:
    def mib(r: dict[str, Any], **keys: str) -> dict[str, Any]:
        return dict(r, **{k: None if r[src] is None else r[src] / MiB for k, src in keys.items()})

    comps = [mib(r, predicted="predicted", measured="measured") for r in out["components"]]
    phases = [mib(r, predicted="predicted", measured="measured", before="measured_before",
                  during="predicted_during") for r in out["phases"]]  # fmt: skip
    g = out["grad_step"]
    rss = ", ".join(f"step {x['step']}: {x['rss_rise'] / MiB:.1f} MiB" for x in g["measured_rss_rise"])
    cols = [("predicted", "predicted MiB (plan)", ".2f"), ("measured", "measured MiB (run)", ".2f"),
            ("ratio", "ratio", ".3f")]  # fmt: skip
    within = ("within", f"within {out['tolerance']:.0%}", "")
    phase_cols = [("phase", "phase", ""), *cols, ("before", "measured MiB (step before)", ".2f"), within,
                  ("during", "plan's peak during the phase MiB", ".2f"),
                  ("below_during", "measured <= it", "")]  # fmt: skip
    return "\n".join(
        [
            "Components (PREDICTED by the plan for the cpu target vs MEASURED by the run's own byte counts):",
            table(comps, [("component", "component", ""), *cols, within]),
            "",
            "Bytes in use at the end of each phase (setup, then the last step; PREDICTED vs MEASURED live"
            " arrays; a step's phase holds when the last step or the one before is within):",
            table(phases, phase_cols),
            "",
            f"grad_step compiled temporaries (PREDICTED, XLA:CPU): {g['temp_bytes'] / MiB:.1f} MiB; "
            f"measured host-RSS rise in train_step: {rss}",
            "",
            "within tolerance: " + ("yes" if out["within"] else "NO"),
        ]
    )


def report_torch(out: dict[str, Any]) -> str:
    b = out["batch"]
    cols = [("quantity", "bytes", ""), ("plan", "plan (fake_tensor)", ","),
            ("live", "live (live_tensors / real step)", ","), ("ratio", "plan / live", ".6f")]  # fmt: skip
    rss = ", ".join(f"{x / MiB:.1f} MiB" for x in out["live_train_step_rss_rise"])
    return "\n".join(
        [
            f"PLAN (predicted, fake tensors) vs LIVE (measured, CPU) - {out['preset']} {out['dtype']}, "
            f"{b['rows']} rows in micro-batches of {b['micro_batch']}, T = {b['seq_len']}",
            table(out["rows"], cols),
            "",
            f"activations + temporaries at the step's peak (plan): {out['plan_activations'] / MiB:.1f} MiB; "
            f"+ gradients: {out['plan_grads_plus_activations'] / MiB:.1f} MiB",
            f"host RSS rise of train_step (live, per step): {rss}",
            "targets: "
            + ", ".join(f"{k} {'pass' if t['pass'] else 'FAIL'}" for k, t in out["targets"].items()),
        ]
    )


def report_plan(out: dict[str, Any]) -> str:
    first = out["plans"][0]
    t = first["target"]
    lines = [
        f"PREDICTED (torch planner) - {out['preset']} on {t['name']} ({t['device_kind']}, "
        f"{t['hbm_bytes'] / GiB:.2f} GiB from {t['source']}); micro-batch {out['micro_batch']} x "
        f"{out['seq_len']}"
    ]
    lines += [
        f"  {k}: {v['bytes_per_device'] / GiB:.3f} GiB [{v['method']}] {v['detail']}"
        for k, v in first["components"].items()
        if k != "kv_pool"
    ]
    lines += [
        f"  {k}: peak {v['peak_bytes'] / GiB:.3f} GiB, extra {v['extra_bytes'] / GiB:.3f} GiB "
        f"[{v['method']}] {v['detail']}"
        for k, v in first["functions"].items()
    ]
    for p in out["plans"]:
        kv, over = p["components"]["kv_pool"], p["first_overflow"]
        verdict = (
            f"fits: peak {p['peak_bytes'] / GiB:.2f} GiB in {p['peak_phase']}"
            if p["fits"]
            else f"DOES NOT FIT: {over[1]} overflows in {over[0]}"
        )
        lines += [
            "",
            f"{p['schedule']} (budget {p['budget_bytes'] / GiB:.2f} GiB): {verdict}; kv_pool "
            f"{kv['bytes_per_device'] / GiB:.3f} GiB [{kv['method']}] {kv['detail']}",
            _markdown(p) if out["markdown"] else _text(p),
            *(f"- {n}" for n in p["notes"]),
        ]
    return "\n".join([*lines, f"planner host RSS peak: {out['planner_host_rss_peak'] / MiB:.0f} MiB"])


def _text(p: dict[str, Any]) -> str:
    comps = p["components"]
    used = [k for k in comps if any(k in r["resident"] for r in p["phases"])]
    rows = []
    for r in p["phases"]:
        row = {"phase": r["phase"], "total": r["total"] / GiB, "measured": None}
        row.update({k: r["resident"][k] / GiB for k in used if k in r["resident"]})
        row["temp"] = r["function_extra"] / GiB if r["function"] else None
        row["over"] = "OVER" if r["total"] > p["budget_bytes"] else ""
        rows.append(row)
    cols = [("phase", "phase", ""), *((k, f"{k} [{comps[k]['method']}]", ".2f") for k in used)]
    cols += [("temp", "grad_step temp [fake_tensor]", ".2f"), ("total", "predicted GiB", ".2f"),
             ("measured", "measured GiB", ""), ("over", "", "")]  # fmt: skip
    return table(rows, cols)


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
        mark = " **over**" if r["total"] > p["budget_bytes"] else ""
        out.append(f"| {r['phase']} | {res} | {temp} | {r['total'] / GiB:.2f}{mark} | |")
    return "\n".join(out)


def summary(out: dict[str, Any]) -> dict[str, Any]:
    s = {k: out[k] for k in ("bench", "backend", "mode", "preset")}
    if out["mode"] == "plan_only":
        fits = {p["schedule"]: p["fits"] for p in out["plans"]}
        return {**s, "fits": fits, "planner_host_rss_peak": out["planner_host_rss_peak"]}
    s.update(run_dir=out["run_dir"], targets_pass=not failed_targets(out))
    if out["backend"] == "torch":
        return {**s, "ratios": {r["quantity"]: r["ratio"] for r in out["rows"]}}
    t, temp = out["targets"]["within_tolerance"], out["grad_step"]["temp_bytes"] or 0
    return {**s, "within": t["pass"], "worst_deviation": t["value"], "grad_temp_gib": temp / GiB}


def main(argv: list[str] | None = None) -> int:
    return main_with_child(parse_args(argv), live_grads, bench, report, summary, strict=True)

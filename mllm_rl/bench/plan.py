"""The memory plans benchmarked: planner start-up, TPU/GPU target plans, plans vs CUDA and CPU steps.

    python -m mllm_rl.bench plan startup [--repeats 3] [--json OUT]
    python -m mllm_rl.bench plan targets [--cases 4b-v4-8,8b-v5p-8] [--out runs/plans] [--json OUT]
    python -m mllm_rl.bench plan vs-cuda [--preset qwen3-0.6b] [--plan-only | --plan-json PLAN] [--json OUT]
    python -m mllm_rl.bench plan vs-run --backend jax|torch [--plan-only] [--json OUT] [-- RUN FLAGS]

``python -m mllm_rl.bench plan WHAT --help``: what WHAT measures, its flags and its exit codes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mllm_rl.bench import GiB, MiB
from mllm_rl.bench.child import BenchError, bench_argv, child_env, flags, run_cmd, run_json
from mllm_rl.bench.cli import csv_choice, doc_parser, main_with_child, output_flags, positive, target
from mllm_rl.bench.machine import ROOT, bench_json
from mllm_rl.bench.records import truth
from mllm_rl.bench.tables import table
from mllm_rl.memplan.__main__ import EXIT_DOES_NOT_FIT, EXIT_OK
from mllm_rl.memplan.audit import compare, load_records

# -- startup ----------------------------------------------------------------------------------------
STARTUP_CHILD = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
case, comp = sys.argv[1], sys.argv[2]
if case.startswith("on_path"):
    sys.path.insert(0, comp)
if case.startswith("plan_"):
    from mllm_rl.backends.jax import topologies
    spec = topologies.spec({"plan_v4_8": "v4-8", "plan_h100x8": "h100x8"}[case])
    topologies.prepare(spec)
    devs, target = topologies.devices(spec)
    n = len(devs)
else:
    import jax
    n = len(jax.devices())
mods = sorted(m for m in ("libtpu", "jax_cuda12_plugin", "jax_plugins.xla_cuda12") if m in sys.modules)
print(json.dumps({"seconds": time.perf_counter() - t0, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "devices": n, "plugins": mods}))
"""
STARTUP_CASES = ("plain", "on_path", "on_path_cpu", "plan_v4_8", "plan_h100x8")


def startup_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeats", type=positive(), default=3, help="fresh interpreters per case (default 3)")
    output_flags(ap, timeout=None)


def startup_one(case: str, comp: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    if case == "on_path_cpu":
        env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-c", STARTUP_CHILD, case, comp]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    if r.returncode != 0:
        raise ValueError(f"{case}: child failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def startup(args: argparse.Namespace) -> dict[str, Any]:
    """Start-up cost of the plan compilers, and proof that a plain CPU run does not pay it.

    Each case is a fresh interpreter of this venv (median of ``--repeats``: wall time, peak RSS):
    ``plain``, ``import jax; jax.devices()`` as every CPU run starts (the compilers live off
    ``sys.path``, in ``<venv>/plan-compilers``): no plugin may load; ``on_path``, with them on
    ``sys.path`` (JAX loads every plugin it finds); ``on_path_cpu``, that with ``JAX_PLATFORMS=cpu``;
    ``plan_v4_8`` / ``plan_h100x8``, the planner's set-up for a target (``topologies.prepare`` + ``devices``).

    Exit 0 when ``plain`` imported no plugin, 1 otherwise, 2 on bad input.
    """
    from mllm_rl.backends.jax.topologies import compilers_dir

    comp = str(compilers_dir())
    if not os.path.isdir(comp):
        raise ValueError(f"{comp}: not found (scripts/venv.sh jax installs the plan compilers there)")
    rows = []
    for case in STARTUP_CASES:
        runs = [startup_one(case, comp) for _ in range(args.repeats)]
        rows.append({"case": case, "seconds": statistics.median(r["seconds"] for r in runs),
            "rss_mib": statistics.median(r["rss"] for r in runs) / MiB, "devices": runs[0]["devices"],
            "plugins": ",".join(runs[0]["plugins"]) or "none"})  # fmt: skip
    base = rows[0]
    for r in rows:
        r["x_time"] = r["seconds"] / base["seconds"]
        r["x_rss"] = r["rss_mib"] / base["rss_mib"]
    return bench_json("plan_startup", args, compilers=comp, repeats=args.repeats, rows=rows,
        plain_loads_no_plugin=base["plugins"] == "none")  # fmt: skip


def startup_report(out: dict[str, Any]) -> str:
    cols = [("case", "case", ""), ("seconds", "start s (median)", ".2f"), ("x_time", "x plain", ".2f"),
        ("rss_mib", "peak RSS MiB", ".0f"), ("x_rss", "x plain", ".2f"), ("devices", "devices", ""),
        ("plugins", "plugin modules imported", "")]  # fmt: skip
    m = out["machine"]
    where = f"{m.get('host_cpu') or 'CPU'}, {m.get('cpu_count') or os.cpu_count()} cores"
    return "\n".join([
        f"MEASURED ({where}), {out['repeats']} fresh interpreters per case; compilers in {out['compilers']}",
        table(out["rows"], cols),
        "plain CPU start loads no plugin: " + ("yes" if out["plain_loads_no_plugin"] else "NO"),
    ])  # fmt: skip


def startup_summary(out: dict[str, Any]) -> dict[str, Any]:
    return {"bench": "plan_startup", "plain_loads_no_plugin": out["plain_loads_no_plugin"],
        **{r["case"]: round(r["seconds"], 2) for r in out["rows"]}}  # fmt: skip


# -- targets ----------------------------------------------------------------------------------------
BATCH = ["--micro-batch-size", "4", "--seq-len", "4096", "--group-size", "8", "--prompts-per-step", "8"]
KV128K = ["--kv-tokens", "131072"]
# The trainer's memory-lean paths for GPU targets: ModelOptions.for_platform's stacked layers,
# per-block remat and 256-position head chunks (the default everywhere) with chunked attention
# (splash is a TPU kernel; off TPU the default attention is dense).
GPU_LEAN = [x for o in ("scan_layers=true", "remat=block", "attention=chunked", "logprob_chunk=256")
            for x in ("--model-option", o)]  # fmt: skip
FIT_SEQ = ["--micro-batch-size", "1", "--seq-len", "8192", "--fit", "seq_len", "--fit-step", "4096"]
HOST_OPT = ["--model-option", "optimizer_memory=host"]
# a case: its memplan arguments, and multi_stage's expectation: "fits" or "report"
Case = tuple[list[str], str]
MLLM_JAX_ENGINE = ["--micro-batch-size", "1", "--seq-len", "1024", "--kv-tokens", "4096",
                   "--max-running-requests", "16"]  # fmt: skip


def target_case(model: str, target: str, tp: int, *extra: str, expect: str = "report") -> Case:
    return ["--model", model, "--target", target, "--tp", str(tp), *extra], expect


TARGET_CASES: dict[str, Case] = {
    "4b-v4-8": target_case("qwen3-4b", "v4-8", 4, *BATCH, *KV128K, expect="fits"),
    "4b-v4-8-fit-kv": target_case("qwen3-4b", "v4-8", 4, *BATCH, "--fit", "kv", expect="fits"),
    "4b-v4-8-fit-seq": target_case("qwen3-4b", "v4-8", 4, *FIT_SEQ, expect="fits"),
    # MLLM-JAX's v4-8 run of sglang-jax with Qwen3-4B (tp 4, bf16, max_total_tokens 4096,
    # max_running_requests 16): engine weights + KV pool after the weight swap, before any generate
    "4b-v4-8-engine": target_case("qwen3-4b", "v4-8", 4, *MLLM_JAX_ENGINE, expect="fits"),
    # Qwen3-8B full fine-tune at the mixed-precision default on one v4-8: float32 masters and AdamW
    # moments; the moments on the device do not fit, in host memory (streamed by the update) they do
    "8b-v4-8": target_case("qwen3-8b", "v4-8", 4, *BATCH, *KV128K),
    "8b-v4-8-host-opt": target_case("qwen3-8b", "v4-8", 4, *BATCH, *KV128K, *HOST_OPT, expect="fits"),
    "8b-v4-16": target_case("qwen3-8b", "v4-16", 8, *BATCH, *KV128K),
    "8b-v5p-8": target_case("qwen3-8b", "v5p-8", 4, *BATCH, *KV128K),
    "4b-v5e-8": target_case("qwen3-4b", "v5e-8", 8, *BATCH, *KV128K),
    "4b-h100x1": target_case("qwen3-4b", "h100x1", 1, *BATCH, *KV128K, *GPU_LEAN),
    "4b-h100x8": target_case("qwen3-4b", "h100x8", 8, *BATCH, *KV128K, *GPU_LEAN),
    # 8 rows split over the 8 devices (4 rows cannot be: each device computes all 4)
    "4b-h100x8-mb8": target_case(
        "qwen3-4b", "h100x8", 8, *BATCH, "--micro-batch-size", "8", *KV128K, *GPU_LEAN
    ),  # fmt: skip
}
# Measured elsewhere, to hold a plan against: (case, phase of the plan, bytes summed over devices, source).
REFERENCES = {"4b-v4-8-engine": ("setup:continue_generation", 8652005376,
    "demon2036/MLLM-JAX docs/sops/tpu-sglang-jax-qwen3-4b-wandb-memory-logging.md, v4-8 run A: "
    "bytes_in_use_sum after weights_swapped")}  # fmt: skip


def targets_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--cases", type=csv_choice(list(TARGET_CASES)), default=list(TARGET_CASES),
                    help="comma-separated (default: all)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("runs/plans"),
                    help="each case's plan.json/txt/html in OUT/CASE (default runs/plans)")  # fmt: skip
    output_flags(ap, timeout=3600.0, per="plan")


def target_plan(name: str, out: Path, timeout: float) -> dict[str, Any]:
    """One case: its ``python -m mllm_rl.memplan``, and the plan's verdicts and figures."""
    args, expect = TARGET_CASES[name]
    cmd = [sys.executable, "-m", "mllm_rl.memplan", *args, "--out", str(out / name)]
    print(f"[bench] {name}: python {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=child_env())
    row: dict[str, Any] = {"case": name, "command": "python " + " ".join(cmd[1:]), "rc": r.returncode,
        "expect": expect, "wall_s": time.perf_counter() - t0}  # fmt: skip
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
    row.update(target=t["name"], devices=t["num_devices"], hosts=t["num_hosts"], hbm_gib=t["hbm_bytes"] / GiB,
        kv_tokens=info.get("kv_tokens"), mem_fraction_static=info.get("mem_fraction_static"),
        compile_s=sum(info.get("compile_seconds", {}).values()),
        host_rss_gib=info.get("host_peak_rss_bytes", 0) / GiB, summary=doc["summary"],
        fit=doc.get("fit", {}).get("value"))  # fmt: skip
    return row


def targets(args: argparse.Namespace) -> dict[str, Any]:
    """The memory plans of the TPU/GPU acceptance cases, one after another, in one table.

    Each case is one ``python -m mllm_rl.memplan`` (in the JSON and docs/PLAN.md), PREDICTED
    compile-only here by the target's compiler: per schedule the verdict and peak per device, the
    KV pool and ``mem_fraction_static``, compile time, the planner's peak RSS and wall time.

    Exit 0 when every plan ran, every case expected to fit fits (multi_stage) and every plan with a
    measured reference is within 2% of it; 1 otherwise; 2 on bad input.
    """
    rows = [target_plan(name, args.out, args.timeout) for name in args.cases]
    ok = all("error" not in r and (r["expect"] != "fits" or r["multi_stage"]["fits"]) for r in rows)
    ok = ok and all(r["reference"]["within_2pct"] for r in rows if "reference" in r)
    return bench_json("plan_targets", args, rows=rows, ok=ok)


def target_row(r: dict[str, Any]) -> dict[str, Any]:
    if "error" in r:
        return {"case": r["case"], "ms": "ERROR: " + r["error"]}

    def verdict(p: dict[str, Any]) -> str:
        if p["fits"]:
            return f"fits {p['peak_gib']:.2f} ({p['peak_of_hbm']:.0%}) {p['peak_phase']}"
        return f"OVER in {', '.join(dict.fromkeys(p['over']))}"

    return {"case": r["case"], "target": f"{r['target']} ({r['devices']}x{r['hbm_gib']:.2f} GiB)",
        "ms": verdict(r["multi_stage"]), "naive": verdict(r["naive"]), "kv": r["kv_tokens"],
        "frac": r["mem_fraction_static"], "fit": r["fit"], "compile": r["compile_s"],
        "rss": r["host_rss_gib"], "wall": r["wall_s"]}  # fmt: skip


def targets_report(out: dict[str, Any]) -> str:
    cols = [("case", "case", ""), ("target", "target", ""),
        ("ms", "multi_stage (GiB/device, of HBM, at)", ""), ("naive", "naive", ""), ("kv", "KV tokens", ""),
        ("frac", "mem_fraction_static", ""), ("fit", "fitted", ""), ("compile", "compile s", ".0f"),
        ("rss", "host RSS GiB", ".2f"), ("wall", "wall s", ".0f")]  # fmt: skip
    lines = ["PREDICTED (compile-only; libtpu / XLA GPU on this machine):",
             table([target_row(r) for r in out["rows"]], cols)]  # fmt: skip
    for r in out["rows"]:
        if "reference" in r:
            ref, n = r["reference"], r["devices"]
            lines.append(
                f"{r['case']}: {ref['phase']} PREDICTED {ref['predicted_sum'] / GiB:.3f} GiB over {n} devices "
                f"({ref['predicted_sum'] / n / GiB:.3f} per device) vs MEASURED {ref['measured_sum'] / GiB:.3f} "
                f"GiB ({ref['source']}): ratio {ref['ratio']:.4f}"
            )
    return "\n".join(lines)


def targets_summary(out: dict[str, Any]) -> dict[str, Any]:
    return {"bench": "plan_targets", "ok": out["ok"],
        "cases": {r["case"]: r.get("multi_stage", {}).get("fits", r.get("error")) for r in out["rows"]}}  # fmt: skip


# -- vs-cuda ----------------------------------------------------------------------------------------
# the planned step and one more on the GPU: the second runs with the first one's allocator caches
MEASURED_STEPS = 2
CUDA_CASE = ("preset", "micro_batch", "seq_len", "rows", "dtype", "precision", "lora_rank", "timed")


def cuda_flags(ap: argparse.ArgumentParser) -> None:
    # fmt: off
    ap.add_argument("--preset", default="qwen3-0.6b", help="a preset of mllm_rl.presets (default qwen3-0.6b)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="weights' dtype")
    ap.add_argument("--precision", default="mixed", choices=["mixed", "pure"], help="the trainer's (default mixed)")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (default 0: full fine-tune)")
    ap.add_argument("--micro-batch", type=positive(), default=4, help="rows per micro-batch (default 4)")
    ap.add_argument("--rows", type=int, default=0, help="rows per step (default: one micro-batch)")
    ap.add_argument("--seq-len", type=positive(), default=2048, help="tokens per row (default 2048)")
    ap.add_argument("--option", action="append", default=[], help="a model option key=value (repeatable)")
    ap.add_argument("--timed", type=int, default=3, help="timed steps after the measured ones (default 3)")
    ap.add_argument("--plan-only", action="store_true", help="the prediction alone (no GPU)")
    ap.add_argument("--plan-json", type=Path, help="a --plan-only --json file to reuse instead of tracing again")
    # fmt: on
    output_flags(ap, timeout=900.0, per="CUDA step")


def options_of(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """``--option key=value`` as the trainer's (key, value) pairs (``ValueError`` on a bad one)."""
    from mllm_rl.backends.torch.memplan import options_key

    for item in args.option:
        if not item.partition("=")[0] or "=" not in item:
            raise ValueError(f"--option {item!r}: expected key=value")
    return options_key(dict(item.split("=", 1) for item in args.option))


def cuda_case(args: argparse.Namespace) -> dict[str, Any]:
    return {"preset": args.preset, "dtype": args.dtype, "precision": args.precision,
        "lora_rank": args.lora_rank, "rows": args.rows or args.micro_batch,
        "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "options": [list(p) for p in options_of(args)]}  # fmt: skip


def cuda_plan(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's trace of the step (fake tensors, this process)."""
    from mllm_rl.backends.torch import memplan
    from mllm_rl.presets import get_preset

    c = cuda_case(args)
    s = memplan.trainer_step_memory(get_preset(args.preset), args.micro_batch, args.seq_len, rows=c["rows"],
        dtype=args.dtype, lora_rank=args.lora_rank, precision=args.precision,
        options=options_of(args))  # fmt: skip
    return {"case": c, "steps": memplan.STEPS, "peak_bytes": s.peak_total,
        "state_bytes": s.params + s.optimizer, "params_bytes": s.params, "grads_bytes": s.grads,
        "optimizer_bytes": s.optimizer, "activations_bytes": s.activations, "adamw": s.adamw,
        "trace_s": round(s.seconds, 1)}  # fmt: skip


def cuda_child(args: argparse.Namespace) -> dict[str, Any]:
    """``--child``: the step on CUDA, in this (fresh) process."""
    import torch

    from mllm_rl.backends.torch import memplan
    from mllm_rl.backends.torch.model import build_qwen3
    from mllm_rl.backends.torch.trainer import TorchTrainer
    from mllm_rl.presets import get_preset
    from mllm_rl.trainer import TrainConfig

    if not torch.cuda.is_available():
        raise BenchError("no CUDA device: the measured side needs one (--plan-only runs without)")
    c, config, dev = cuda_case(args), get_preset(args.preset), torch.device("cuda")
    torch.manual_seed(0)
    model = build_qwen3(config, getattr(torch, args.dtype), "meta").to_empty(device=dev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    cfg = TrainConfig(micro_batch_size=args.micro_batch, lora_rank=args.lora_rank, precision=args.precision,
                      model_options=options_of(args))  # fmt: skip
    trainer = TorchTrainer(memplan.layout_dir(config, args.dtype), cfg, device=dev, model=model)
    del model
    batch = memplan.step_batch(config, c["rows"], args.seq_len)
    torch.cuda.synchronize()
    out: dict[str, Any] = {
        "case": c,
        "device": torch.cuda.get_device_name(),
        "oom": False,
        "steps": MEASURED_STEPS,
    }
    out["built_bytes"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(MEASURED_STEPS):
            trainer.device_step(batch)
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        out.update(oom=True, error=str(e).splitlines()[0])
    out["peak_bytes"] = torch.cuda.max_memory_allocated()
    out["reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
    out["state_bytes"] = torch.cuda.memory_allocated()
    out["card_bytes"] = torch.cuda.mem_get_info()[1]
    if not out["oom"]:
        times = []
        for _ in range(args.timed):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            trainer.device_step(batch)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out["step_s"] = statistics.median(times) if times else None
        out["tokens_per_s"] = c["rows"] * args.seq_len / out["step_s"] if times else None
    return out


def vs_cuda(args: argparse.Namespace) -> dict[str, Any]:
    """The torch planner's train step next to the same step run on a CUDA GPU, side by side in one run.

    PREDICTED: ``backends/torch/memplan.py: trainer_step_memory`` (fake tensors, any CPU; ``--plan-only
    --json P`` writes it, ``--plan-json P`` reuses it). MEASURED: the same ``device_step`` calls on
    this CUDA device in a fresh process: ``max_memory_allocated`` and ``max_memory_reserved``, and
    the median of ``--timed`` more steps.

    Target: measured / predicted peak <= 1.01. Exit 0: measured (an out-of-memory is reported, not
    failed); 1 the measurement failed; 2 bad input.
    """
    options_of(args)  # bad input before anything runs
    if args.plan_json:
        predicted = json.loads(args.plan_json.read_text())
        predicted = predicted.get("predicted", predicted)
        if predicted.get("case") != cuda_case(args):
            raise ValueError(
                f"--plan-json {args.plan_json}: planned for {predicted.get('case')}, not {cuda_case(args)}"
            )
    else:
        predicted = cuda_plan(args)
    out = bench_json(
        "plan_vs_cuda", args, backend="torch", preset=args.preset, platform="cuda", predicted=predicted
    )
    if args.plan_only:
        return out
    opts = [x for o in args.option for x in ("--option", o)]
    cmd = bench_argv("plan", "vs-cuda", "--child", *flags(**{k: getattr(args, k) for k in CUDA_CASE}), *opts)
    m = run_json(cmd, "the CUDA step", timeout=args.timeout)
    out["measured"] = m
    out["peak_over_plan"] = m["peak_bytes"] / predicted["peak_bytes"]
    out["state_over_plan"] = m["state_bytes"] / predicted["state_bytes"]
    # the plan may not miss more than 1% of the step's peak (an out-of-memory leaves the peak short)
    out["targets"] = {"peak_over_plan": target(None if m["oom"] else out["peak_over_plan"], "<=", 1.01)}
    return out


def cuda_report(out: dict[str, Any]) -> str:
    p, m = out["predicted"], out.get("measured")
    c = p["case"]
    opts = " ".join(f"{k}={v}" for k, v in c["options"]) or "defaults"
    rows = [{"what": what, "pred": pk and p[pk] / GiB, "meas": m and m[mk] / GiB} for what, pk, mk in (
        ("peak (tensors)", "peak_bytes", "peak_bytes"),
        ("state after (params + AdamW)", "state_bytes", "state_bytes"),
        ("reserved peak (allocator)", None, "reserved_peak_bytes"))]  # fmt: skip
    for r in rows:
        r["ratio"] = r["meas"] / r["pred"] if r["meas"] is not None and r["pred"] else None
    cols = [("what", "", ""), ("pred", "PREDICTED GiB (fake tensors)", ".2f"),
            ("meas", "MEASURED GiB", ".2f"), ("ratio", "measured / predicted", ".4f")]  # fmt: skip
    text = (f"{c['preset']} {c['dtype']} {c['precision']}, lora {c['lora_rank']}, {c['rows']} rows x "
            f"{c['seq_len']} tokens in micro-batches of {c['micro_batch']}, options {opts}; {p['steps']} "
            f"device_step calls\n{table(rows, cols)}")  # fmt: skip
    if m:
        text += f"\nmeasured on {m['device']} (card {m['card_bytes'] / GiB:.2f} GiB)"
        text += (
            " OUT OF MEMORY: " + m["error"]
            if m["oom"]
            else f"; step {m['step_s']:.3f} s, {m['tokens_per_s']:.0f} tokens/s"
        )
    return text


def cuda_summary(out: dict[str, Any]) -> dict[str, Any]:
    m = out.get("measured") or {}
    return {"case": out["predicted"]["case"],
        "predicted_peak_gib": round(out["predicted"]["peak_bytes"] / GiB, 3),
        "measured_peak_gib": round(m["peak_bytes"] / GiB, 3) if m else None,
        "peak_over_plan": out.get("peak_over_plan"), "oom": m.get("oom"),
        "tokens_per_s": m.get("tokens_per_s")}  # fmt: skip


# -- vs-run -----------------------------------------------------------------------------------------
# Per backend: the default tolerance and plan target, and the run's own flags (torch's comparison
# reads no checkpoint phase, and a real model's checkpoint costs GBs of disk; JAX's compares it).
BACKENDS = {
    "jax": {"tolerance": 0.05, "target": "cpu", "run_flags": []},
    "torch": {"tolerance": 0.01, "target": "h100", "run_flags": ["--save-every", "0"]},
}
# torch's flags and their defaults (parsed as None: a jax comparison refuses them when given)
TORCH_ONLY = dict(seq_len=32, plan_only=False, micro_batch=4, prompts=8, group_size=8, margin=0.9)


def run_flags(ap: argparse.ArgumentParser) -> None:
    # fmt: off
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
    ap.add_argument("--margin", type=float, help="--plan-only: fraction of device memory a phase may use (0.9)")
    ap.add_argument("--markdown", action="store_true", help="--plan-only: the per-phase tables in Markdown")
    ap.add_argument("--run-arg", action="append", default=[], help="an argument for mllm_rl.run (repeatable)")
    # fmt: on
    output_flags(ap, timeout=3600.0, per="subprocess", extra="more arguments for mllm_rl.run (after --)")


def run_check(args: argparse.Namespace, ap: argparse.ArgumentParser) -> None:
    """Each backend's defaults filled in; a flag of the other backend or a bad value: ``ap.error``."""
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


def results(args: argparse.Namespace, mode: str, **fields: Any) -> dict[str, Any]:
    """The JSON of either mode: what ran, then ``fields``."""
    return bench_json("plan_vs_run", args, ("backend",), mode=mode, preset=args.model, **fields)


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
    # --seq-len: jax the longest a training row can be (what the run compiles); torch the rows it trains
    return flags(backend=args.backend, target=args.target, model=run["model"],
        micro_batch_size=train["micro_batch_size"],
        seq_len=eng["context_length"] if args.backend == "jax" else args.seq_len,
        kv_tokens=eng["max_total_tokens"], tp=eng["tp"], max_running_requests=eng["max_running_requests"],
        group_size=run["group_size"], prompts_per_step=run["prompts_per_step"], lora_rank=train["lora_rank"],
        kl_beta=train["loss"]["beta"], precision=train["precision"], schedule=run["schedule"])  # fmt: skip


def vs_run(args: argparse.Namespace) -> dict[str, Any]:
    """Predicted vs measured on CPU: the memory plan of a run held against what that run measured.

    Runs ``python -m mllm_rl.run --backend B --platform cpu`` (after ``--`` and ``--run-arg``: its
    flags) unless ``--run-dir`` holds a finished run, plans it with ``python -m mllm_rl.memplan``
    and the run's knobs, and compares. jax (tolerance 5%): per component and phase end
    (``mllm_rl.memplan.audit``). torch (1%): params and optimizer state against the run's
    ``live_tensors``, gradients against one real step. ``--plan-only`` (torch, no run): the plan of
    ``--preset`` on ``--target``, both schedules, phase by phase.

    Exit 0 every comparison within the tolerance, 1 one is not or a run failed, 2 bad input.
    """
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
    child = bench_argv(
        "plan", "vs-run", "--backend", "torch", "--child", *flags(run_dir=run_dir, seq_len=args.seq_len)
    )
    grads = run_json(child, "live gradients", timeout=args.timeout)
    live = {"params": max(params), "optimizer": max(b - p for b, p in zip(both, params, strict=True)),
            "grads": grads["grads"]}  # fmt: skip
    plan = doc["plans"][doc["schedule"]]
    c, f = plan["components"], plan["functions"]["grad_step"]
    rows, targets = [], {}
    for k, v in live.items():
        p = c["trainer_params" if k == "params" else k]["bytes_per_device"]
        rows.append({"quantity": k, "plan": p, "live": v, "ratio": p / v if v else None})
        off = abs(p / v - 1) if v else None
        targets[f"{k}_within_{round(args.tolerance * 100, 6):g}pct"] = target(off, "<=", args.tolerance)
    host = [r["memory"]["host"] for r in by["train_step"]]
    batch = {"rows": rows_of(run), "micro_batch": run["train"]["micro_batch_size"], "seq_len": args.seq_len}
    return {"dtype": plan["inputs"]["param_dtype"], "batch": batch, "rows": rows, "targets": targets,
        "plan_activations": f["temp_bytes"], "plan_grad_step_extra": f["extra_bytes"],
        "plan_grad_step_peak": f["peak_bytes"],
        "plan_grads_plus_activations": c["grads"]["bytes_per_device"] + f["temp_bytes"],
        "live_train_step_rss_rise": [h["rss_peak_bytes"] - h["rss_start_bytes"] for h in host],
        "plan_notes": plan["notes"]}  # fmt: skip


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


def run_report(out: dict[str, Any]) -> str:
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
    return "\n".join([
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
    ])  # fmt: skip


def report_torch(out: dict[str, Any]) -> str:
    b = out["batch"]
    cols = [("quantity", "bytes", ""), ("plan", "plan (fake_tensor)", ","),
            ("live", "live (live_tensors / real step)", ","), ("ratio", "plan / live", ".6f")]  # fmt: skip
    rss = ", ".join(f"{x / MiB:.1f} MiB" for x in out["live_train_step_rss_rise"])
    return "\n".join([
        f"PLAN (predicted, fake tensors) vs LIVE (measured, CPU) - {out['preset']} {out['dtype']}, "
        f"{b['rows']} rows in micro-batches of {b['micro_batch']}, T = {b['seq_len']}",
        table(out["rows"], cols),
        "",
        f"activations + temporaries at the step's peak (plan): {out['plan_activations'] / MiB:.1f} MiB; "
        f"+ gradients: {out['plan_grads_plus_activations'] / MiB:.1f} MiB",
        f"host RSS rise of train_step (live, per step): {rss}",
        "targets: " + ", ".join(f"{k} {'pass' if t['pass'] else 'FAIL'}" for k, t in out["targets"].items()),
    ])  # fmt: skip


def report_plan(out: dict[str, Any]) -> str:
    first = out["plans"][0]
    t = first["target"]
    lines = [
        f"PREDICTED (torch planner) - {out['preset']} on {t['name']} ({t['device_kind']}, "
        f"{t['hbm_bytes'] / GiB:.2f} GiB from {t['source']}); micro-batch {out['micro_batch']} x {out['seq_len']}"
    ]
    lines += [
        f"  {k}: {v['bytes_per_device'] / GiB:.3f} GiB [{v['method']}] {v['detail']}"
        for k, v in first["components"].items()
        if k != "kv_pool"
    ]
    lines += [f"  {k}: peak {v['peak_bytes'] / GiB:.3f} GiB, extra {v['extra_bytes'] / GiB:.3f} GiB "
              f"[{v['method']}] {v['detail']}" for k, v in first["functions"].items()]  # fmt: skip
    for p in out["plans"]:
        kv, over = p["components"]["kv_pool"], p["first_overflow"]
        verdict = (f"fits: peak {p['peak_bytes'] / GiB:.2f} GiB in {p['peak_phase']}" if p["fits"]
                   else f"DOES NOT FIT: {over[1]} overflows in {over[0]}")  # fmt: skip
        lines += ["", f"{p['schedule']} (budget {p['budget_bytes'] / GiB:.2f} GiB): {verdict}; kv_pool "
                  f"{kv['bytes_per_device'] / GiB:.3f} GiB [{kv['method']}] {kv['detail']}",
                  markdown_phases(p) if out["markdown"] else text_phases(p),
                  *(f"- {n}" for n in p["notes"])]  # fmt: skip
    return "\n".join([*lines, f"planner host RSS peak: {out['planner_host_rss_peak'] / MiB:.0f} MiB"])


def text_phases(p: dict[str, Any]) -> str:
    """The plan of one schedule, phase by phase, as a text table."""
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


def markdown_phases(p: dict[str, Any]) -> str:
    """The plan of one schedule as a Markdown table (what docs/BENCHMARKS.md shows)."""
    comps = p["components"]
    out = ["| phase | resident, GiB per device [method] | + temporaries GiB [method] | predicted GiB | "
           "measured GiB (H100) |", "|---|---|---|---|---|"]  # fmt: skip
    for r in p["phases"]:
        res = ", ".join(f"{k} {v / GiB:.2f} [{comps[k]['method']}]" for k, v in r["resident"].items()) or "-"
        temp = f"{r['function_extra'] / GiB:.2f} ({r['function']}) [fake_tensor]" if r["function"] else "-"
        mark = " **over**" if r["total"] > p["budget_bytes"] else ""
        out.append(f"| {r['phase']} | {res} | {temp} | {r['total'] / GiB:.2f}{mark} | |")
    return "\n".join(out)


def run_summary(out: dict[str, Any]) -> dict[str, Any]:
    s = {k: out[k] for k in ("bench", "backend", "mode", "preset")}
    if out["mode"] == "plan_only":
        fits = {p["schedule"]: p["fits"] for p in out["plans"]}
        return {**s, "fits": fits, "planner_host_rss_peak": out["planner_host_rss_peak"]}
    s.update(
        run_dir=out["run_dir"], targets_pass=all(t["pass"] is not False for t in out["targets"].values())
    )
    if out["backend"] == "torch":
        return {**s, "ratios": {r["quantity"]: r["ratio"] for r in out["rows"]}}
    t, temp = out["targets"]["within_tolerance"], out["grad_step"]["temp_bytes"] or 0
    return {**s, "within": t["pass"], "worst_deviation": t["value"], "grad_temp_gib": temp / GiB}


# -- the command line -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Mode:
    """One WHAT: its flags, the benchmark (its docstring: the ``--help`` text), report, summary; as
    ``cli.main_with_child`` takes them; ``check``: defaults and checks after parsing."""

    flags: Callable[[argparse.ArgumentParser], None]
    bench: Callable[[argparse.Namespace], dict[str, Any]]
    report: Callable[[dict[str, Any]], str]
    summary: Callable[[dict[str, Any]], dict[str, Any]]
    strict: bool | Callable[[dict[str, Any]], bool] = False
    child: Callable[[argparse.Namespace], dict[str, Any]] | None = None
    check: Callable[[argparse.Namespace, argparse.ArgumentParser], None] | None = None


MODES = {
    "startup": Mode(startup_flags, startup, startup_report, startup_summary,
                    strict=lambda out: not out["plain_loads_no_plugin"]),
    "targets": Mode(targets_flags, targets, targets_report, targets_summary, strict=lambda out: not out["ok"]),
    "vs-cuda": Mode(cuda_flags, vs_cuda, cuda_report, cuda_summary, child=cuda_child),
    "vs-run": Mode(run_flags, vs_run, run_report, run_summary, strict=True, child=live_grads,
                   check=run_check),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``WHAT`` and its flags, checked (exit 2 and one line on a bad one)."""
    ap = doc_parser(__doc__)
    sub = ap.add_subparsers(dest="what", required=True, metavar="WHAT")
    for name, mode in MODES.items():
        head, _, rest = inspect.cleandoc(mode.bench.__doc__ or "").partition("\n\n")
        p = sub.add_parser(name, help=head, description=head, epilog=rest,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
        mode.flags(p)
        if mode.child:
            p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
        p.set_defaults(parser=p)
    args = ap.parse_args(argv)
    if MODES[args.what].check:
        MODES[args.what].check(args, args.parser)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    m = MODES[args.what]
    return main_with_child(args, m.child, m.bench, m.report, m.summary, strict=m.strict)

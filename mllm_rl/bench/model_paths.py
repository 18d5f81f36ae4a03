"""Old vs new JAX model path, compiled ahead of time for a TPU target on this (CPU) machine.

    python -m mllm_rl.bench model-paths --model qwen3-0.6b --target v4-8 --batch 4 --seq 1024
    python -m mllm_rl.bench model-paths --model qwen3-4b --batch 4 --seq 4096 --paths new --json out.json

Per path, in its own process: the trainer's ``grad`` (or ``logprob``) step lowered on abstract
inputs over the target's devices and compiled by libtpu; per device the predicted argument /
output / temp / peak bytes (``memory_analysis``; RESOURCE_EXHAUSTED when it does not fit), the
measured compile seconds and host RSS, and new / old ratios. ``old`` = no scan, no remat, whole
head; ``new`` = ``ModelOptions.for_platform("tpu")``; both with ``--tp``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

from mllm_rl.bench import GiB
from mllm_rl.bench.child import BenchError, bench_argv, flags
from mllm_rl.bench.cli import csv_choice, doc_parser, main_with_child, positive, progress
from mllm_rl.bench.machine import ROOT, bench_json
from mllm_rl.bench.tables import table

TARGETS = ("v4-8",)  # TPU slices of mllm_rl.backends.jax.topologies this bench compiles for
PATHS = ("old", "new")
FNS = ("grad", "logprob")


def path_options(path: str, tp: int) -> Any:
    from mllm_rl.backends.jax.options import ModelOptions

    if path == "old":
        return ModelOptions(tp=tp, scan_layers=False, remat="none", logprob_chunk=0)
    return ModelOptions.for_platform("tpu", tp=tp)


def compile_one(args: argparse.Namespace) -> dict[str, Any]:
    """In the child process: lower and compile one path, return its figures."""
    from mllm_rl.backends.jax import topologies

    spec = topologies.spec(args.target)
    topologies.prepare(spec)  # before jax: CPU runtime, libtpu from the planner's compilers dir
    from mllm_rl.backends.jax.sharding import make_mesh
    from mllm_rl.backends.jax.step_fns import SCALAR, abstract_state, batch_specs, make_step_fns
    from mllm_rl.presets import get_preset
    from mllm_rl.rl.loss_config import LossConfig
    from mllm_rl.trainer import TrainConfig

    devices = topologies.topology_devices(spec)
    model_cfg = get_preset(args.model)
    train_cfg = TrainConfig(lora_rank=args.lora_rank, loss=LossConfig(beta=0.0))
    opts = path_options(args.child, args.tp)
    mesh = make_mesh(args.tp, devices)
    fns = make_step_fns(model_cfg, train_cfg, opts, mesh)
    trainable, frozen, _ = abstract_state(model_cfg, train_cfg, opts, mesh)
    mb = batch_specs(args.batch, args.seq, mesh)
    t0 = time.perf_counter()
    if args.fn == "grad":
        lowered = fns.grad.lower(trainable, frozen, mb, SCALAR, SCALAR)
    else:
        lowered = fns.logprob.lower(trainable, frozen, mb["tokens"], mb["attn"])
    lower_s = time.perf_counter() - t0
    out: dict[str, Any] = {"path": args.child, "options": dataclasses.asdict(opts),
        "devices": len(devices), "lower_s": round(lower_s, 2), "hlo_chars": len(lowered.as_text())}  # fmt: skip
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # libtpu refuses a program that does not fit: RESOURCE_EXHAUSTED
        msg = str(e)
        if "RESOURCE_EXHAUSTED" not in msg:
            raise
        out.update(fits=False, error=msg.strip().splitlines()[0][:400])
    else:
        m = compiled.memory_analysis()
        out.update(fits=True, argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
                   alias_bytes=m.alias_size_in_bytes, temp_bytes=m.temp_size_in_bytes,
                   peak_bytes=m.peak_memory_in_bytes)  # fmt: skip
    out["compile_s"] = round(time.perf_counter() - t1, 2)
    out["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def run_path(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """One path in a fresh process of this interpreter (its own RSS and compile cache)."""
    cmd = bench_argv("model-paths", "--child", path) + flags(
        model=args.model, target=args.target, batch=args.batch, seq=args.seq, fn=args.fn, tp=args.tp,
        lora_rank=args.lora_rank,
    )  # fmt: skip
    progress(
        f"compiling the {path} path ({args.model}, {args.fn}, {args.batch} x {args.seq}, {args.target}) ..."
    )
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"path": path, "fits": None, "error": f"did not compile within --timeout {args.timeout}s"}
    if r.returncode != 0:
        tail = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
        killed = r.returncode < 0 or r.returncode == 137
        return {"path": path, "fits": None,
            "error": ("killed (host memory?): " if killed else "") + tail[:400],
            "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    progress(f"  {path}: compiled in {res['compile_s']} s")
    return res


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from mllm_rl.backends.jax import topologies
    from mllm_rl.presets import get_preset

    get_preset(args.model)  # ValueError (exit 2) before anything starts
    topologies.prepare(topologies.spec(args.target))  # ValueError (exit 2) without the compiler
    libtpu = topologies.libtpu_version()
    results = {p: run_path(args, p) for p in args.paths}
    method = f"predicted: XLA TPU compiler memory_analysis (libtpu {libtpu}); compile_s and host RSS measured on this machine"  # fmt: skip
    keys = ("target", "model", "fn", "batch", "seq", "tp", "lora_rank")
    out = bench_json("model_paths", args, keys, libtpu=libtpu, method=method, paths=results)
    old, new = results.get("old"), results.get("new")
    if old and new and old.get("fits") and new.get("fits"):
        keys = ("peak_bytes", "temp_bytes", "compile_s", "host_peak_rss_bytes")
        out["ratios_new_over_old"] = {k: round(new[k] / old[k], 3) for k in keys if old[k]}
    if not any(r.get("fits") is not None for r in results.values()):
        raise BenchError(
            "no path compiled: " + "; ".join(f"{p}: {r.get('error')}" for p, r in results.items())
        )
    return out


def report(out: dict[str, Any]) -> str:
    rows = []
    for p, r in out["paths"].items():
        row = {"path": p, "fits": r.get("fits"), "compile_s": r.get("compile_s"), "lower_s": r.get("lower_s")}
        for k in ("argument_bytes", "output_bytes", "temp_bytes", "peak_bytes", "host_peak_rss_bytes"):
            row[k] = r[k] / GiB if r.get(k) is not None else None
        rows.append(row)
    cols = [("path", "path", ""), ("fits", "fits", ""), ("argument_bytes", "args GiB", ".2f"),
        ("output_bytes", "out GiB", ".2f"), ("temp_bytes", "temp GiB", ".2f"),
        ("peak_bytes", "peak GiB", ".2f"), ("compile_s", "compile s", ".1f"),
        ("host_peak_rss_bytes", "host RSS GiB", ".2f")]  # fmt: skip
    lines = [
        f"{out['model']} {out['fn']} step, micro-batch {out['batch']} x {out['seq']}, {out['target']} "
        f"(tp {out['tp']}), per device; memory predicted by libtpu {out['libtpu']}, time/RSS measured here",
        table(rows, cols),
    ]
    lines += [f"{p}: {r['error']}" for p, r in out["paths"].items() if r.get("error")]
    if "ratios_new_over_old" in out:
        lines.append("new / old: " + ", ".join(f"{k} {v}" for k, v in out["ratios_new_over_old"].items()))
    return "\n".join(lines)


def summary(out: dict[str, Any]) -> dict[str, Any]:
    return {"bench": "model_paths", "model": out["model"], "target": out["target"],
        **{f"{p}_peak_bytes": r.get("peak_bytes") for p, r in out["paths"].items()},
        "ratios_new_over_old": out.get("ratios_new_over_old")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = doc_parser(__doc__)
    # fmt: off
    ap.add_argument("--model", default="qwen3-0.6b", help="a preset of mllm_rl.presets (default qwen3-0.6b)")
    ap.add_argument("--target", default="v4-8", choices=TARGETS, help="TPU slice to compile for")
    ap.add_argument("--batch", type=positive(), default=4, help="micro-batch rows (default 4)")
    ap.add_argument("--seq", type=positive(), default=1024, help="positions per row (default 1024)")
    ap.add_argument("--fn", default="grad", choices=FNS, help="the step function to compile (default grad)")
    ap.add_argument("--paths", type=csv_choice(PATHS), default=list(PATHS), help="old,new (default both)")
    ap.add_argument("--tp", type=positive(), default=1, help="tensor-parallel size of the mesh (default 1: FSDP)")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (default 0: full fine-tune)")
    ap.add_argument("--timeout", type=positive(float), default=3600.0, help="seconds per path (default 3600)")
    ap.add_argument("--json", type=Path, help="write the full results here")
    ap.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    # fmt: on
    args = ap.parse_args(argv)
    if args.lora_rank < 0:
        ap.error(f"--lora-rank must be >= 0, got {args.lora_rank}")
    return main_with_child(args, compile_one, bench, report, summary)

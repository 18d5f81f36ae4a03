"""The torch planner's train step next to the same step run on a CUDA GPU, side by side in one run.

    python -m mllm_rl.bench plan-vs-cuda --preset qwen3-4b --micro-batch 4 --seq-len 4096 \
        --option remat=true --option adamw=fused
    python -m mllm_rl.bench plan-vs-cuda --preset qwen3-0.6b --micro-batch 4 --seq-len 2048
    python -m mllm_rl.bench plan-vs-cuda ... --plan-only --json plan.json       # no GPU needed
    python -m mllm_rl.bench plan-vs-cuda ... --plan-json plan.json              # reuse that plan

Predicted: ``backends/torch/memplan.py: trainer_step_memory`` (the real ``TorchTrainer`` on fake
tensors under MemTracker), on any machine's CPU. Measured: the same trainer and ``STEPS`` calls of
``device_step`` on this machine's CUDA device in a fresh process, with seeded random weights;
``max_memory_allocated`` is the figure the plan predicts, ``max_memory_reserved`` adds the caching
allocator's blocks; step time is the median of ``--timed`` further calls, in tokens per second.

Target: measured / predicted peak <= 1.01. Exit 0: measured; 1 the measurement failed (an
out-of-memory is reported, not failed); 2 bad input. The last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from mllm_rl.bench import GiB
from mllm_rl.bench.child import BenchError, bench_argv, run_json
from mllm_rl.bench.cli import doc_parser, main_with_child, positive, target
from mllm_rl.bench.machine import bench_json
from mllm_rl.bench.tables import table


def options_of(args: argparse.Namespace) -> tuple[tuple[str, Any], ...]:
    """``--option key=value`` as the trainer's (key, value) pairs (``ValueError`` on a bad one)."""
    from mllm_rl.backends.torch.memplan import options_key

    pairs: list[tuple[str, Any]] = []
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--option {item!r}: expected key=value")
        pairs.append((key, value))
    return options_key(dict(pairs))


def case(args: argparse.Namespace) -> dict[str, Any]:
    return {"preset": args.preset, "dtype": args.dtype, "precision": args.precision,
        "lora_rank": args.lora_rank, "rows": args.rows or args.micro_batch,
        "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "options": [list(p) for p in options_of(args)]}  # fmt: skip


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """The planner's trace of the step (fake tensors, this process)."""
    from mllm_rl.backends.torch import memplan
    from mllm_rl.presets import get_preset

    c = case(args)
    s = memplan.trainer_step_memory(
        get_preset(args.preset),
        args.micro_batch,
        args.seq_len,
        rows=c["rows"],
        dtype=args.dtype,
        lora_rank=args.lora_rank,
        precision=args.precision,
        options=options_of(args),
    )
    return {"case": c, "steps": memplan.STEPS, "peak_bytes": s.peak_total,
        "state_bytes": s.params + s.optimizer, "params_bytes": s.params, "grads_bytes": s.grads,
        "optimizer_bytes": s.optimizer, "activations_bytes": s.activations, "adamw": s.adamw,
        "trace_s": round(s.seconds, 1)}  # fmt: skip


def measure_child(args: argparse.Namespace) -> dict[str, Any]:
    """The step on CUDA, in this (fresh) process."""
    import torch

    from mllm_rl.backends.torch import memplan
    from mllm_rl.backends.torch.model import build_qwen3
    from mllm_rl.backends.torch.trainer import TorchTrainer
    from mllm_rl.presets import get_preset
    from mllm_rl.trainer import TrainConfig

    if not torch.cuda.is_available():
        raise BenchError("no CUDA device: the measured side needs one (--plan-only runs without)")
    c = case(args)
    config = get_preset(args.preset)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    model = build_qwen3(config, getattr(torch, args.dtype), "meta").to_empty(device=dev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    cfg = TrainConfig(
        micro_batch_size=args.micro_batch,
        lora_rank=args.lora_rank,
        precision=args.precision,
        model_options=options_of(args),
    )
    trainer = TorchTrainer(memplan.layout_dir(config, args.dtype), cfg, device=dev, model=model)
    del model
    batch = memplan.step_batch(config, c["rows"], args.seq_len)
    torch.cuda.synchronize()
    out: dict[str, Any] = {"case": c, "device": torch.cuda.get_device_name(), "oom": False}
    out["built_bytes"] = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    try:
        for _ in range(memplan.STEPS):
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


def child_cmd(args: argparse.Namespace) -> list[str]:
    cmd = bench_argv("plan-vs-cuda", "--child", "--preset", args.preset)
    cmd += ["--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--rows", str(args.rows)]
    cmd += ["--dtype", args.dtype, "--precision", args.precision, "--lora-rank", str(args.lora_rank)]
    cmd += ["--timed", str(args.timed)]
    for o in args.option:
        cmd += ["--option", o]
    return cmd


def bench(args: argparse.Namespace) -> dict[str, Any]:
    options_of(args)  # bad input before anything runs
    if args.plan_json:
        predicted = json.loads(args.plan_json.read_text())
        predicted = predicted.get("predicted", predicted)
        if predicted.get("case") != case(args):
            raise ValueError(
                f"--plan-json {args.plan_json}: planned for {predicted.get('case')}, not {case(args)}"
            )
    else:
        predicted = plan(args)
    out: dict[str, Any] = bench_json(
        "plan_vs_cuda", args, backend="torch", preset=args.preset, platform="cuda", predicted=predicted
    )
    if args.plan_only:
        return out
    m = run_json(child_cmd(args), "the CUDA step", timeout=args.timeout)
    out["measured"] = m
    out["peak_over_plan"] = m["peak_bytes"] / predicted["peak_bytes"]
    out["state_over_plan"] = m["state_bytes"] / predicted["state_bytes"]
    # the plan may not miss more than 1% of the step's peak (an out-of-memory leaves the peak short)
    out["targets"] = {"peak_over_plan": target(None if m["oom"] else out["peak_over_plan"], "<=", 1.01)}
    return out


def report(out: dict[str, Any]) -> str:
    p, m = out["predicted"], out.get("measured")
    c = p["case"]
    opts = " ".join(f"{k}={v}" for k, v in c["options"]) or "defaults"
    head = (
        f"{c['preset']} {c['dtype']} {c['precision']}, lora {c['lora_rank']}, {c['rows']} rows x {c['seq_len']} "
        f"tokens in micro-batches of {c['micro_batch']}, options {opts}; {p['steps']} device_step calls"
    )
    rows = [
        {"what": "peak (tensors)", "pred": p["peak_bytes"] / GiB, "meas": m and m["peak_bytes"] / GiB},
        {
            "what": "state after (params + AdamW)",
            "pred": p["state_bytes"] / GiB,
            "meas": m and m["state_bytes"] / GiB,
        },
        {"what": "reserved peak (allocator)", "pred": None, "meas": m and m["reserved_peak_bytes"] / GiB},
    ]
    for r in rows:
        r["ratio"] = r["meas"] / r["pred"] if r["meas"] is not None and r["pred"] else None
    cols = [("what", "", ""), ("pred", "PREDICTED GiB (fake tensors)", ".2f"),
        ("meas", "MEASURED GiB", ".2f")]  # fmt: skip
    text = head + "\n" + table(rows, [*cols, ("ratio", "measured / predicted", ".4f")])
    if m:
        text += f"\nmeasured on {m['device']} (card {m['card_bytes'] / GiB:.2f} GiB)"
        text += (
            " OUT OF MEMORY: " + m["error"]
            if m["oom"]
            else f"; step {m['step_s']:.3f} s, {m['tokens_per_s']:.0f} tokens/s"
        )
    return text


def summary(out: dict[str, Any]) -> dict[str, Any]:
    m = out.get("measured") or {}
    return {"case": out["predicted"]["case"],
        "predicted_peak_gib": round(out["predicted"]["peak_bytes"] / GiB, 3),
        "measured_peak_gib": round(m["peak_bytes"] / GiB, 3) if m else None,
        "peak_over_plan": out.get("peak_over_plan"), "oom": m.get("oom"),
        "tokens_per_s": m.get("tokens_per_s")}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = doc_parser(__doc__)
    ap.add_argument("--preset", default="qwen3-0.6b", help="a preset of mllm_rl.presets (default qwen3-0.6b)")
    ap.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="weights' dtype"
    )
    ap.add_argument(
        "--precision", default="mixed", choices=["mixed", "pure"], help="the trainer's (default mixed)"
    )
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (default 0: full fine-tune)")
    ap.add_argument("--micro-batch", type=positive(), default=4, help="rows per micro-batch (default 4)")
    ap.add_argument("--rows", type=int, default=0, help="rows per step (default: one micro-batch)")
    ap.add_argument("--seq-len", type=positive(), default=2048, help="tokens per row (default 2048)")
    ap.add_argument("--option", action="append", default=[], help="a model option key=value (repeatable)")
    ap.add_argument("--timed", type=int, default=3, help="timed steps after the measured ones (default 3)")
    ap.add_argument("--plan-only", action="store_true", help="the prediction alone (no GPU)")
    ap.add_argument(
        "--plan-json", type=Path, help="a --plan-only --json file to reuse instead of tracing again"
    )
    ap.add_argument(
        "--timeout", type=positive(float), default=900.0, help="seconds for the CUDA step (default 900)"
    )
    ap.add_argument("--json", type=Path, help="write the full results here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return main_with_child(parse_args(argv), measure_child, bench, report, summary)

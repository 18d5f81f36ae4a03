"""The torch Qwen3's training-step paths side by side on CPU: attention, log-prob head, remat.

Eager vs SDPA attention, the chunked log-prob head, per-block activation checkpointing.

    python -m mllm_rl.bench torch-attention                      # qwen3-0.6b cut to 4 layers, 1 x 1024
    python -m mllm_rl.bench torch-attention --preset tiny --seq 4096 --batch 2
    python -m mllm_rl.bench torch-attention --paths eager,sdpa --json out.json
    python -m mllm_rl.bench torch-attention --preset tiny --layers 0 --seq 2048 --dtype float32 \
        --paths sdpa+chunked,sdpa+chunked+remat --baseline sdpa+chunked   # remat vs none

**A CPU figure.** Paths (``backends/torch/model.py``): ``eager`` (plain attention and head),
``sdpa`` (``scaled_dot_product_attention``), ``sdpa+chunked`` (and the head in chunks recomputed in
the backward: what the trainer runs), ``sdpa+chunked+remat`` (and every layer under
``torch.utils.checkpoint``). A step: forward and backward of seeded random weights in ``--dtype``.
**Measured**: step time with the paths interleaved in one process (median of ``--steps``), the
peak RSS rise of each path alone in a fresh process. **Predicted**: the torch planner's
activations at the forward/backward peak of one ``TorchTrainer`` step on fake tensors. Ratios
are over ``--baseline``; the last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from mllm_rl.bench import MiB
from mllm_rl.bench.child import BenchError, bench_argv, flags, run_json
from mllm_rl.bench.cli import csv_choice, doc_parser, main_with_child, positive, progress
from mllm_rl.bench.machine import bench_json
from mllm_rl.bench.tables import table

PATHS = ("eager", "sdpa", "sdpa+chunked", "sdpa+chunked+remat")
DEFAULT_PATHS = PATHS[:3]  # the attention comparison; the remat path on request
DTYPES = ("bfloat16", "float32")


def path_settings(path: str) -> tuple[str, str | None, bool]:
    """(model attention, logprob chunk: ``"model"`` = the model's default, None = the whole head,
    per-block activation checkpointing)."""
    chunked = path.startswith("sdpa+chunked")
    return ("eager" if path == "eager" else "sdpa"), ("model" if chunked else None), path.endswith("+remat")


def config_of(args: argparse.Namespace) -> Any:
    from mllm_rl.presets import get_preset

    c = get_preset(args.preset)
    return dataclasses.replace(c, num_hidden_layers=args.layers) if args.layers else c


def rss_bytes() -> int:
    """This process's resident set now (``/proc/self/statm``)."""
    import os

    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def build(args: argparse.Namespace, path: str) -> tuple[Any, Any]:
    """The model of ``path`` with seeded random weights, and its ``step()`` (seconds)."""
    import torch

    from mllm_rl.backends.torch.model import build_qwen3

    torch.manual_seed(0)
    c = config_of(args)
    attention, chunk, remat = path_settings(path)
    model = build_qwen3(c, getattr(torch, args.dtype), "meta", attention, remat).to_empty(device="cpu")  # fmt: skip
    if chunk is None:
        model.logprob_chunk = None
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, c.vocab_size, (args.batch, args.seq), generator=g)
    mask = torch.ones(args.batch, args.seq, dtype=torch.bool)
    mask[-1, args.seq * 3 // 4 :] = False  # one right-padded row: no attention mask needed
    weight = mask[:, 1:].float()

    def step() -> float:
        t0 = time.perf_counter()
        lp = model(tokens[:, :-1], None, targets=tokens[:, 1:], temperature=0.7)
        loss = -(lp * weight).sum() / weight.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    return model, step


def set_threads(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    return torch.get_num_threads()


def rss_one(args: argparse.Namespace) -> dict[str, Any]:
    """In a child, one path alone: the RSS rise of a warm-up step and one more."""
    threads = set_threads(args)
    model, step = build(args, args.child)
    rss0 = rss_bytes()
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step()
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"path": args.child, "params": sum(p.numel() for p in model.parameters()), "rss_before_bytes": rss0,
            "rss_peak_rise_bytes": peak - rss0,
            "rise_is_lower_bound": peak <= peak0,  # the steps never passed the set-up's peak
            "threads": threads}  # fmt: skip


def times_all(args: argparse.Namespace) -> dict[str, Any]:
    """In a child, every path's model at once, their steps interleaved (path A, B, C, A, B, C, ...)
    so a busy machine slows each alike: per path the warm-up and the timed steps."""
    threads = set_threads(args)
    steps = {p: build(args, p)[1] for p in args.paths}
    warm = {p: round(f(), 3) for p, f in steps.items()}
    times: dict[str, list[float]] = {p: [] for p in steps}
    for _ in range(args.steps):
        for p, f in steps.items():
            times[p].append(round(f(), 3))
    return {"threads": threads, "warmup_s": warm, "step_s_all": times}


def child_cmd(args: argparse.Namespace, *extra: str) -> list[str]:
    return bench_argv("torch-attention", *extra) + flags(
        preset=args.preset, layers=args.layers, batch=args.batch, seq=args.seq, dtype=args.dtype,
        steps=args.steps, threads=args.threads, paths=",".join(args.paths), baseline=args.baseline,
    )  # fmt: skip


def plan_one(args: argparse.Namespace, path: str) -> dict[str, Any]:
    """The planner's figures for one trainer step of this shape (fake tensors, in this process)."""
    from mllm_rl.backends.torch import memplan

    attention, chunk, remat = path_settings(path)
    s = memplan.trainer_step_memory(config_of(args), args.batch, args.seq, rows=args.batch, dtype=args.dtype,
        steps=1, attention=attention, logprob_chunk=chunk, options=(("remat", True),) if remat else ())  # fmt: skip
    # at the forward/backward peak: with remat the step's peak may lie in the optimizer step
    return {"activations_bytes": s.fwd_bwd_activations, "peak_bytes": s.peak_total,
        "trace_s": round(s.seconds, 1)}  # fmt: skip


def bench(args: argparse.Namespace) -> dict[str, Any]:
    c = config_of(args)  # ValueError (exit 2) for an unknown preset, before anything runs
    results: dict[str, dict[str, Any]] = {}
    for p in args.paths:
        progress(f"measuring the RSS of {p} ...")
        results[p] = run_json(child_cmd(args, "--child", p), f"path {p}", timeout=args.timeout)
        results[p]["planned"] = plan_one(args, p)
    progress(f"timing {', '.join(args.paths)} interleaved, {args.steps} steps each ...")
    timing = run_json(child_cmd(args, "--child-times"), "timing", timeout=args.timeout)
    for p, r in results.items():
        r["warmup_s"] = timing["warmup_s"][p]
        r["step_s_all"] = timing["step_s_all"][p]
        r["step_s"] = round(statistics.median(r["step_s_all"]), 3)
    method = (
        "step_s (paths interleaved in one process) and rss_peak_rise (a fresh process per path) measured on "
        "this CPU, model forward + backward; planned = torch planner, fake tensors (a TorchTrainer step; predicted)"
    )
    out = bench_json(
        "torch_attention", args, (), figure="CPU", preset=args.preset, layers=c.num_hidden_layers
    )
    out.update(
        batch=args.batch, seq=args.seq, dtype=args.dtype, steps=args.steps, method=method, paths=results
    )
    base = results.get(args.baseline)
    out["baseline"] = args.baseline
    if base:
        act = lambda r: r["planned"]["activations_bytes"]  # noqa: E731
        out[f"ratios_over_{args.baseline}"] = {p: {"step_s": round(r["step_s"] / base["step_s"], 3),
            "rss_peak_rise": round(r["rss_peak_rise_bytes"] / max(base["rss_peak_rise_bytes"], 1), 3),
            "planned_activations": round(act(r) / max(act(base), 1), 3)} for p, r in results.items()}  # fmt: skip
    if not results:
        raise BenchError("no path ran")
    return out


def report(out: dict[str, Any]) -> str:
    base = out["baseline"]
    ratios = out.get(f"ratios_over_{base}", {})
    rows = [{"path": p, "step_s": r["step_s"], "step_x": ratios.get(p, {}).get("step_s"),
             "rise": r["rss_peak_rise_bytes"] / MiB, "rise_x": ratios.get(p, {}).get("rss_peak_rise"),
             "planned": r["planned"]["activations_bytes"] / MiB,
             "planned_x": ratios.get(p, {}).get("planned_activations")} for p, r in out["paths"].items()]  # fmt: skip
    cols = [("path", "path", ""), ("step_s", "step s", ".3f"), ("step_x", f"x {base}", ".3f"),
        ("rise", "RSS rise MiB", ".1f"), ("rise_x", f"x {base}", ".3f"),
        ("planned", "planned act. MiB", ".1f"), ("planned_x", f"x {base}", ".3f")]  # fmt: skip
    first = next(iter(out["paths"].values()))
    head = (
        f"CPU figure: {out['preset']} ({out['layers']} layers, {first['params']:,} params, {out['dtype']}), "
        f"{out['batch']} x {out['seq']} tokens, forward + backward, median of {out['steps']} steps; "
        f"{first['threads']} thread(s), load {out['machine'].get('load_avg_1m')}"
    )
    lines = [head, table(rows, cols),
        "step s: measured here, the paths interleaved in one process; RSS rise: measured here, a fresh "
        "process per path; planned act.: the torch planner's activations + temporaries at the forward/"
        "backward peak of one trainer step of the same shape (fake tensors, predicted)"]  # fmt: skip
    if any(r["rise_is_lower_bound"] for r in out["paths"].values()):
        lines.append("(a RSS rise marked as a lower bound: the steps stayed under the set-up's peak)")
    return "\n".join(lines)


def summary(out: dict[str, Any]) -> dict[str, Any]:
    return {"bench": "torch_attention", "figure": "CPU", "preset": out["preset"],
        "shape": [out["batch"], out["seq"]],
        **{f"{p}_step_s": r["step_s"] for p, r in out["paths"].items()},
        f"ratios_over_{out['baseline']}": out.get(f"ratios_over_{out['baseline']}")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = doc_parser(__doc__)
    # fmt: off
    ap.add_argument("--preset", default="qwen3-0.6b", help="a preset of mllm_rl.presets (default qwen3-0.6b)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4; 0: the preset's)")
    ap.add_argument("--batch", type=positive(), default=1, help="rows (default 1)")
    ap.add_argument("--seq", type=positive(), default=1024, help="tokens per row (default 1024)")
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="params and compute (default bfloat16)")
    ap.add_argument("--steps", type=positive(), default=5, help="timed steps after one warm-up (default 5)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: steadiest on a shared machine; 0: torch's default)")
    ap.add_argument("--paths", type=csv_choice(PATHS), default=list(DEFAULT_PATHS),
                    help=f"{','.join(PATHS)} (default {','.join(DEFAULT_PATHS)})")
    ap.add_argument("--baseline", default="eager", choices=PATHS, help="the path the ratios divide by (default eager)")
    ap.add_argument("--timeout", type=positive(float), default=1800.0, help="seconds per path (default 1800)")
    ap.add_argument("--json", type=Path, help="write the full results here")
    ap.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    ap.add_argument("--child-times", action="store_true", help=argparse.SUPPRESS)
    # fmt: on
    args = ap.parse_args(argv)
    if args.layers < 0 or args.threads < 0:
        ap.error(f"--layers and --threads must be >= 0, got {args.layers}, {args.threads}")
    if args.baseline not in args.paths:
        ap.error(f"--baseline {args.baseline}: not one of --paths {','.join(args.paths)}")
    child = rss_one if args.child else times_all
    args.child = args.child or args.child_times
    return main_with_child(args, child, bench, report, summary)

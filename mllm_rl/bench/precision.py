"""Mixed vs pure precision at a fine-tuning learning rate: does a 16-bit checkpoint learn?

    python -m mllm_rl.bench precision                                  # tiny in bf16, torch, CPU
    python -m mllm_rl.bench precision --backend jax
    python -m mllm_rl.bench precision --model qwen3-0.6b --platform cuda --json OUT.json
    python -m mllm_rl.bench precision -- --prompts-per-step 4            # extra flags for every run

One ``mllm_rl.run ... --precision P --checkpoint-every 1`` per P in a fresh process, the preset in
``--dtype``: the share of trained weights changed between the last two checkpoints (zero when every
group's rewards are equal: said so), log-prob mismatch, ``ratio_mean``, ``train_step`` seconds and
peak bytes, and mixed / pure ratios. Exit 0 with the results, 2 on bad input, 1 when a run failed.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from mllm_rl.bench import MiB
from mllm_rl.bench.child import run_argv, run_cmd
from mllm_rl.bench.cli import positive, run_bench
from mllm_rl.bench.machine import command_line, machine_info
from mllm_rl.bench.tables import table
from mllm_rl.sinks.jsonl import read_jsonl

PRECISIONS = ("mixed", "pure")
METRICS = ("reward_mean", "groups_zero_std", "ratio_mean", "logp_mismatch_mean", "logp_mismatch_max",
           "engine_ratio_mean")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # fmt: off
    ap.add_argument("--backend", default="torch", choices=["torch", "jax"])
    ap.add_argument("--model", default="tiny", help="preset (written in --dtype)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--platform", default="cpu", help="--platform of the runs (cpu, cuda, tpu)")
    ap.add_argument("--steps", type=positive(int), default=3, help="RL steps per run (>= 2)")
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of both runs")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("extra", nargs="*", help="after --: flags for every run")
    # fmt: on
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2 (changes are measured between two steps' checkpoints)")
    return args


def load_trained(ckpt: Path, backend: str) -> dict[str, np.ndarray]:
    """The trained tensors of one RL checkpoint as float64 numpy, by name."""
    if backend == "torch":
        from mllm_rl.backends.torch.state_file import load_state

        state = load_state(ckpt)
        return {n: t.detach().double().numpy() for n, t in state["trainable"].items()}
    import jax
    import orbax.checkpoint as ocp

    tree = ocp.StandardCheckpointer().restore((ckpt / "state").resolve())
    leaves = jax.tree_util.tree_leaves_with_path(tree.get("trainable", tree))
    return {jax.tree_util.keystr(p): np.asarray(x, np.float64) for p, x in leaves}


def changed_share(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """Elements that differ between two checkpoints' tensors / all elements."""
    diff = sum(int(np.count_nonzero(a[n] != b[n])) for n in a)
    return diff / max(sum(x.size for x in a.values()), 1)


def one_run(args: argparse.Namespace, model: str, precision: str, work: Path) -> dict[str, Any]:
    run_dir = work / precision
    cmd = run_argv(
        run_dir, *args.extra, backend=args.backend, model=model, platform=args.platform, precision=precision,
        lr=args.lr, temperature=args.temperature, steps=args.steps, checkpoint_every=1,
    )  # fmt: skip
    run_cmd(cmd, f"{precision} run", timeout=args.timeout)
    steps = sorted((run_dir / "checkpoints").glob("step_*"))
    states = [load_trained(s, args.backend) for s in steps]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    train = [p for p in read_jsonl(run_dir / "phases.jsonl") if p["phase"] == "train_step"]
    peaks = [d.get("phase_peak_bytes") for p in train for d in p["memory"]["devices"]]
    return {"precision": precision, "checkpoints": [s.name for s in steps],
        "changed": [changed_share(a, b) for a, b in zip(states, states[1:], strict=False)],
        "per_step": [{k: m.get(k) for k in ("step", *METRICS)} for m in metrics],
        "train_step_s": statistics.median(p["t_end"] - p["t_start"] for p in train[1:] or train),
        "train_step_peak_bytes": max((x for x in peaks if x is not None), default=None)}  # fmt: skip


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from mllm_rl.checkpoint.resolve import resolve_model

    model = resolve_model(args.model, dtype=args.dtype)  # ValueError / CheckpointError: exit 2
    work = Path(tempfile.mkdtemp(prefix="bench-precision-"))
    try:
        runs = {p: one_run(args, str(model.path), p, work) for p in PRECISIONS}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    m, p = ({"changed_last": r["changed"][-1], **r} for r in (runs["mixed"], runs["pure"]))
    keys = ("changed_last", "train_step_s", "train_step_peak_bytes")
    ratios = {k: None if m[k] is None or not p[k] else m[k] / p[k] for k in keys}
    return {"machine": machine_info(), "command": command_line(), "backend": args.backend, "model": args.model,
            "dtype": args.dtype, "lr": args.lr, "temperature": args.temperature, "runs": runs,
            "ratios_mixed_over_pure": ratios}  # fmt: skip


def report(out: dict[str, Any]) -> str:
    rows = []
    for p, r in out["runs"].items():
        first, last = (r["per_step"][0], r["per_step"][-1]) if r["per_step"] else ({}, {})
        rows.append({"precision": p, "changed": " ".join(f"{c:.4f}" for c in r["changed"]),
            "mismatch": last.get("logp_mismatch_mean"), "mismatch_max": last.get("logp_mismatch_max"),
            "ratio0": first.get("ratio_mean") if r["per_step"] else None, "s": r["train_step_s"],
            "peak": (r["train_step_peak_bytes"] or 0) / MiB})  # fmt: skip
    cols = [("precision", "precision", ""), ("changed", "changed per step pair", ""),
        ("ratio0", "ratio_mean step 0", ".4f"), ("mismatch", "mismatch mean (last)", ".2e"),
        ("mismatch_max", "max", ".2e"), ("s", "train_step s", ".3f"), ("peak", "train peak MiB", ".1f")]  # fmt: skip
    head = (f"{out['model']} ({out['dtype']}), {out['backend']}, lr {out['lr']:g}, T {out['temperature']:g}; "
            f"measured on {out['machine'].get('host_cpu')}, GPUs {out['machine'].get('gpus') or 'none'}")  # fmt: skip
    r = out["ratios_mixed_over_pure"]
    silent = [
        p for p, run in out["runs"].items() if all(m.get("groups_zero_std") == 1 for m in run["per_step"])
    ]
    warn = (f"no learning signal in {', '.join(silent)}: every group's rewards were equal (advantage 0, no "
            f"gradient), so 'changed' says nothing about precision (a random-weight model scores 0 on the task)")  # fmt: skip
    tail = "mixed / pure: " + ", ".join(f"{k} {v:.3g}" if v is not None else f"{k} -" for k, v in r.items())
    return "\n".join([head, table(rows, cols), tail] + ([warn] if silent else []))


def summary(out: dict[str, Any]) -> dict[str, Any]:
    return {"bench": "precision", **{f"changed_{p}": r["changed"] for p, r in out["runs"].items()},
        **out["ratios_mixed_over_pure"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    code, _ = run_bench(bench, parse_args(argv), report, summary)
    return code

"""One torch RL run as 1 process and as 2 (FSDP2-sharded, and replicated with --fsdp 1), side by side.

    python -m mllm_rl.bench processes [--model tiny] [--steps 3] [--json OUT] [--keep DIR] [-- RUN FLAGS]

Each case is ``python -m mllm_rl.launch --nproc N -- --backend torch ...`` (CPU: gloo), the flags
after ``--`` last (they win). From the phase records: median ``train_step`` and step seconds after
the first step (process 0), the trainer's bytes per process, step 0's reward / loss / grad norm
(equal up to float32 reduction noise: the same run). On a CPU the processes share the cores: the
time ratios are not a scaling figure. ``--keep DIR`` keeps the runs (``one``, ``two``, ``dp``).

Exit 0 when every run succeeded and the sharded run's per-process trainer bytes are at most
0.55 x the one-process run's; 1 otherwise; 2 on bad input.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from mllm_rl.bench.child import flags
from mllm_rl.bench.cli import doc_parser, main_with_child, positive, target
from mllm_rl.bench.machine import ROOT, bench_json
from mllm_rl.bench.tables import table
from mllm_rl.sinks.jsonl import read_jsonl

# (name, processes, flags, directory name)
CASES = (("1 process", 1, [], "one"), ("2 processes, FSDP2", 2, [], "two"),
         ("2 processes, --fsdp 1", 2, ["--fsdp", "1"], "dp"))  # fmt: skip
SHARD_BOUND = 0.55  # a sharded process holds half the state, and FSDP2's padding of a last shard


def parse_args(argv: list[str] | None = None) -> Any:
    ap = doc_parser(__doc__)
    # fmt: off
    ap.add_argument("--model", default="tiny", help="preset or checkpoint dir")
    ap.add_argument("--steps", type=positive(), default=3)
    ap.add_argument("--prompts-per-step", type=positive(), default=8)
    ap.add_argument("--group-size", type=positive(), default=8)
    ap.add_argument("--max-new-tokens", type=positive(), default=16)
    ap.add_argument("--micro-batch-size", type=positive(), default=16)
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here (one, two, dp)")
    ap.add_argument("run_flags", nargs="*", help="flags for every run, after --")
    # fmt: on
    return ap.parse_args(argv)


def _run(args: Any, nproc: int, extra: list[str], run_dir: Path) -> None:
    given = {k: getattr(args, k) for k in ("model", "steps", "prompts_per_step", "group_size", "max_new_tokens",
                                           "micro_batch_size")}  # fmt: skip
    run = flags(
        backend="torch", **given, checkpoint_every=0, wandb="disabled", console="off", run_dir=run_dir
    )
    cmd = [sys.executable, "-m", "mllm_rl.launch", "--nproc", str(nproc), "--", *run, *extra, *args.run_flags]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=dict(os.environ))
    if r.returncode != 0:
        raise ValueError(f"{' '.join(cmd)}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}")


def _row(name: str, nproc: int, run_dir: Path) -> dict[str, Any]:
    recs = read_jsonl(run_dir / "phases.jsonl")
    later = [x for x in recs if x.get("step") not in (None, 0)]
    train = [x["t_end"] - x["t_start"] for x in later if x["phase"] == "train_step"]
    steps: dict[int, float] = {}
    for x in later:
        steps[x["step"]] = steps.get(x["step"], 0.0) + x["t_end"] - x["t_start"]
    per_proc = []
    for i in range(nproc):
        p = read_jsonl(run_dir / ("phases.jsonl" if i == 0 else f"phases.p{i}.jsonl"))
        last = [x for x in p if x["phase"] == "train_step"][-1]
        per_proc.append(last["memory"]["devices"][0]["bytes_in_use"])
    m0 = read_jsonl(run_dir / "metrics.jsonl")[0]
    return {"case": name, "processes": nproc, "train_step_s": statistics.median(train) if train else None,
        "step_s": statistics.median(steps.values()) if steps else None,
        "trainer_mib": max(per_proc) / 2**20, "reward0": m0["reward_mean"], "loss0": m0["loss"],
        "grad_norm0": m0["grad_norm"]}  # fmt: skip


def bench(args: Any) -> dict[str, Any]:
    rows = []
    if args.keep is not None and any((args.keep / d).exists() for *_, d in CASES):
        raise ValueError(f"--keep {args.keep}: already holds a run directory (one, two or dp)")
    with tempfile.TemporaryDirectory(prefix="bench-processes-") as tmp:
        for name, nproc, extra, dirname in CASES:
            run_dir = (args.keep or Path(tmp)) / dirname
            _run(args, nproc, extra, run_dir)
            rows.append(_row(name, nproc, run_dir))
    base = rows[0]
    for r in rows:
        for k in ("train_step_s", "step_s", "trainer_mib"):
            r[f"x_{k}"] = r[k] / base[k] if r[k] and base[k] else None
    sharded = rows[1]["x_trainer_mib"]
    return bench_json(
        "processes", args, rows=rows, targets={"sharded_trainer_bytes": target(sharded, "<=", SHARD_BOUND)}
    )


def report(out: dict[str, Any]) -> str:
    cols = [("case", "case", ""), ("train_step_s", "train_step s", ".3f"),
        ("x_train_step_s", "x 1 proc", ".2f"), ("step_s", "step s", ".3f"), ("x_step_s", "x 1 proc", ".2f"),
        ("trainer_mib", "trainer MiB/process", ".2f"), ("x_trainer_mib", "x 1 proc", ".3f"),
        ("reward0", "step 0 reward", ".4f"), ("loss0", "step 0 loss", ".3e"),
        ("grad_norm0", "step 0 grad norm", ".6f")]  # fmt: skip
    where = out["machine"].get("cpu") or f"{os.cpu_count()} CPUs"
    t = out["targets"]["sharded_trainer_bytes"]
    return "\n".join([
        f"MEASURED ({where}); medians over the steps after the first, process 0's phases; the processes share "
        "this machine's cores (not a scaling figure)",
        table(out["rows"], cols),
        f"sharded trainer bytes per process {t['value']:.3f} x the one-process run's (target <= {SHARD_BOUND}): "
        + ("met" if t["pass"] else "NOT MET"),
    ])  # fmt: skip


def summary(out: dict[str, Any]) -> dict[str, Any]:
    return {"bench": "processes",
            **{r["case"]: {"train_step_s": r["train_step_s"], "trainer_mib": round(r["trainer_mib"], 3)} for r in out["rows"]},
            "sharded_trainer_bytes_met": out["targets"]["sharded_trainer_bytes"]["pass"]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    failed = lambda o: not o["targets"]["sharded_trainer_bytes"]["pass"]  # noqa: E731
    return main_with_child(parse_args(argv), None, bench, report, summary, strict=failed)

"""Step cost: the share of each lifecycle phase in a colocated RL step, side by side for models and backends.

    python -m mllm_rl.bench step-cost                        # tiny and qwen3-0.6b, jax and torch
    python -m mllm_rl.bench step-cost --models tiny --steps 3 --json OUT
    python -m mllm_rl.bench step-cost --models qwen3-0.6b -- --prompts-per-step 2 --group-size 2
    python -m mllm_rl.bench step-cost --from-run runs/a --from-run runs/b     # recorded runs, no new run

One ``python -m mllm_rl.run`` per model and backend in a fresh process (``--python-jax`` /
``--python-torch``, default the repo's venvs; arguments after ``--`` go to every run), or the
recorded runs of ``--from-run``. Per phase: medians over the counted steps (complete, error-free,
not an attempt's first, which compiles) of its seconds, its share of the step's wall time (gaps:
``between_phases``; a repeated name: ``empty_cache#2``) and the bytes it moved. ``non-rollout,
non-train`` is the lifecycle's own cost, also derived for a checkpoint every 5 steps. After each
new run, ``python -m mllm_rl.bench copy`` in the same interpreter measures the copy baseline
(``--no-baseline``: not): ``update_weights``'s rate over its ``h2d`` copy of as many bytes.

Exit 0 with the results, 2 on bad input (one line), 1 when a run failed (``--keep-going``: the
others go on). Times are wall-clock; the load average around each run is recorded."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mllm_rl.bench import MiB
from mllm_rl.bench.child import BenchError, run_argv, run_cmd
from mllm_rl.bench.cli import csv_choice, csv_list, doc_parser, output_flags, positive, progress, run_bench
from mllm_rl.bench.copy_bandwidth import baseline
from mllm_rl.bench.machine import ROOT, bench_json, load_avg_1m
from mllm_rl.bench.tables import merge_orders, table
from mllm_rl.plans.rl import RLOptions

RUN_CADENCE = RLOptions.checkpoint_every  # python -m mllm_rl.run's default: a checkpoint every 5 steps
BACKENDS = ("jax", "torch")
ROLLOUT, TRAIN, CHECKPOINT = "rollout", "train_step", "checkpoint"
BETWEEN = "between_phases"
BYTE_FIELDS = ("bytes", "expected_alloc_bytes", "expected_freed_bytes")
OTHER = f"non-{ROLLOUT}, non-{TRAIN}"


# -- the analysis of one run's phase records ---------------------------------------------------
@dataclasses.dataclass
class Step:
    """One step's records, reduced to seconds and ``info`` per phase key."""

    step: int
    attempt: int
    first_of_attempt: bool
    wall_s: float
    seconds: dict[str, float]  # phase key -> seconds, in order
    info: dict[str, dict[str, Any]]
    error: str | None = None

    @property
    def between_s(self) -> float:
        return max(0.0, self.wall_s - sum(self.seconds.values()))

    @property
    def other(self) -> float:
        """The non-rollout, non-train share of the step."""
        return (self.wall_s - self.seconds.get(ROLLOUT, 0.0) - self.seconds.get(TRAIN, 0.0)) / self.wall_s


def split_steps(records: Sequence[dict[str, Any]]) -> list[Step]:
    """The steps of ``records`` (one process's phase log, in order), each attempt's apart."""
    attempt, stepped_before = 0, False
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("step") is None:
            attempt += stepped_before  # setup records after steps: a resumed attempt (or the final eval)
            stepped_before = False
            continue
        groups.setdefault((attempt, int(r["step"])), []).append(r)
        stepped_before = True
    first: dict[int, int] = {}
    for a, s in groups:
        first[a] = min(first.get(a, s), s)
    steps = []
    for (a, s), recs in groups.items():
        keys = _keys([r["phase"] for r in recs])
        info = {k: r.get("info") or {} for k, r in zip(keys, recs, strict=True)}
        seconds = {k: float(r["t_end"]) - float(r["t_start"]) for k, r in zip(keys, recs, strict=True)}
        error = next((i["error"] for i in info.values() if i.get("error")), None)
        wall = float(recs[-1]["t_end"]) - float(recs[0]["t_start"])
        steps.append(Step(s, a, s == first[a], wall, seconds, info, error))
    return steps


def counted(steps: Sequence[Step], expected: Sequence[str] | None = None) -> list[Step]:
    """The steps that count. ``expected``: the phase names of one step (``run.json``'s
    ``expected_step_phases``); without it, the phase set most steps have."""
    keys = [_keys(expected)] if expected else [tuple(s.seconds) for s in steps]
    want = max(set(keys), key=keys.count) if keys else ()
    return [s for s in steps if not s.first_of_attempt and s.error is None and tuple(s.seconds) == want]


def _keys(names: Sequence[str]) -> tuple[str, ...]:
    """Phase names made unique: the k-th repeat of ``NAME`` is ``NAME#k``."""
    out: list[str] = []
    for n in names:
        key, k = n, 2
        while key in out:
            key, k = f"{n}#{k}", k + 1
        out.append(key)
    return tuple(out)


def moved_bytes(info: dict[str, Any]) -> int | None:
    """The bytes a phase moved, as its record says (None when it says nothing)."""
    vals = [info.get(f) for f in BYTE_FIELDS]
    return next((v for v in vals if isinstance(v, int) and not isinstance(v, bool)), None)


def _median(xs: Sequence[float | None], nd: int | None = None) -> float | None:
    vals = [x for x in xs if x is not None]
    med = statistics.median(vals) if vals else None
    return med if med is None or nd is None else round(med, nd)


def other_share_at_cadence(use: Sequence[Step], every: int) -> float | None:
    """Median non-rollout, non-train share with each save's ``checkpoint`` seconds spread over
    ``every`` steps; None when no step saved or a save ran in the background (it overlaps)."""
    if any(s.info.get(CHECKPOINT, {}).get("background") for s in use):
        return None
    shares = []
    for s in use:
        if s.info.get(CHECKPOINT, {}).get("path"):  # a save begun
            ck = s.seconds[CHECKPOINT]
            wall = s.wall_s - ck + ck / every
            shares.append((wall - s.seconds.get(ROLLOUT, 0.0) - s.seconds.get(TRAIN, 0.0)) / wall)
    return _median(shares, 6)


def analyse(
    records: Sequence[dict[str, Any]], expected: Sequence[str] | None = None, cadence: int | None = None
) -> dict[str, Any]:
    """Per-phase medians over the counted steps; ``ValueError`` when no step counts. ``cadence``:
    also the share with a checkpoint every ``cadence`` steps."""
    steps = split_steps(records)
    use = counted(steps, expected)
    if not use:
        raise ValueError(
            f"no complete step after the first of its run ({len(steps)} step(s) recorded): "
            "the first step compiles and is left out, so run --steps >= 2"
        )
    phases = []
    for k in use[0].seconds:
        nbytes = _median([moved_bytes(s.info[k]) for s in use])
        med = statistics.median(s.seconds[k] for s in use)
        phases.append({"phase": k, "seconds_median": round(med, 6),
            "share_median": _median([s.seconds[k] / s.wall_s for s in use], 6),
            "bytes_median": int(nbytes) if nbytes is not None else None,
            "gbps_median": round(nbytes / med / 1e9, 4) if nbytes and med > 0 else None})  # fmt: skip
    phases.append({"phase": BETWEEN, "seconds_median": _median([s.between_s for s in use], 6),
        "share_median": _median([s.between_s / s.wall_s for s in use], 6), "bytes_median": None,
        "gbps_median": None})  # fmt: skip
    first = [s for s in steps if s.first_of_attempt and s.attempt == 0]
    step_med = statistics.median(s.wall_s for s in use)
    ck = [s.info.get(CHECKPOINT, {}) for s in use]
    return {"steps_recorded": len(steps), "steps_counted": [s.step for s in use],
        "step_s_median": round(step_med, 6), "first_step_s": round(first[0].wall_s, 6) if first else None,
        "first_over_median": round(first[0].wall_s / step_med, 3) if first and step_med > 0 else None,
        "other_share_median": _median([s.other for s in use], 6),
        # time-weighted over the counted steps: the share of the whole run's step time
        "other_share_total": round(sum(s.other * s.wall_s for s in use) / sum(s.wall_s for s in use), 6),
        "checkpoints_background": sum(bool(c.get("background")) for c in ck),
        "other_s_median": _median([s.other * s.wall_s for s in use], 6), "cadence": cadence,
        "other_share_at_cadence": other_share_at_cadence(use, cadence) if cadence else None,
        "phases": phases, "update": _update_detail(use),
        "checkpoints_saved": sum(bool(c.get("path")) for c in ck)}  # fmt: skip


def _update_detail(use: Sequence[Step]) -> dict[str, Any] | None:
    """``update_weights``: the engine's install (``info.seconds``) vs the rest (export, fingerprints)."""
    recs = [
        (s.seconds["update_weights"], s.info["update_weights"]) for s in use if "update_weights" in s.seconds
    ]
    if not recs:
        return None
    around = [1 - i["seconds"] / t for t, i in recs if isinstance(i.get("seconds"), (int, float)) and t > 0]
    return {"full_updates": sum(bool(i.get("full")) for _, i in recs), "updates": len(recs),
        "tensors": recs[0][1].get("tensors"), "install_s_median": _median([i.get("seconds") for _, i in recs]),
        "phase_s_median": round(statistics.median(t for t, _ in recs), 6),
        "around_install_share_median": _median(around, 4)}  # fmt: skip


# -- inputs --------------------------------------------------------------------------------
def python_for(backend: str, args: argparse.Namespace) -> str:
    """The interpreter for ``backend``'s runs; ``ValueError`` when the one given does not exist."""
    given = args.python_jax if backend == "jax" else args.python_torch
    if given:
        found = shutil.which(given) if os.sep not in given else (given if os.access(given, os.X_OK) else None)
        if not found:
            raise ValueError(f"--python-{backend} {given!r}: no such executable")
        return given
    venv = ROOT / f".venv-{backend}" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


def read_run(run_dir: Path) -> dict[str, Any]:
    """``run.json`` and the records of ``phases.jsonl`` of one run; ``ValueError`` naming the file."""
    from mllm_rl.phases.schema import validate_record
    from mllm_rl.sinks.jsonl import read_jsonl

    meta_path, phases_path = run_dir / "run.json", run_dir / "phases.jsonl"
    for p in (meta_path, phases_path):
        if not p.is_file():
            raise ValueError(f"{p}: not found (--from-run takes a run directory of python -m mllm_rl.run)")
    try:
        meta = json.loads(meta_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{meta_path}: not JSON ({e.msg}, line {e.lineno})") from None
    if meta.get("plan", "rl") != "rl" or not isinstance(meta.get("expected_step_phases"), list):
        raise ValueError(f"{meta_path}: not an RL run (no expected_step_phases)")
    records = read_jsonl(phases_path)
    for i, r in enumerate(records):
        try:
            validate_record(r)
        except ValueError as e:
            raise ValueError(f"{phases_path}: record {i + 1}: {e}") from None
    argv = meta.get("argv") or []
    model = argv[argv.index("--model") + 1] if "--model" in argv[:-1] else Path(str(meta.get("model"))).name
    return {"meta": meta, "records": records, "model": model, "backend": meta.get("backend")}


# -- driver --------------------------------------------------------------------------------
def one(label: str, model: str, backend: str, run: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    try:
        analysis = analyse(run["records"], run["meta"].get("expected_step_phases"), cadence=RUN_CADENCE)
    except ValueError as e:
        raise ValueError(f"{label}: {e}") from None
    return {"label": label, "model": model, "backend": backend, **extra, "analysis": analysis}


def new_run(args: argparse.Namespace, model: str, backend: str, run_dir: Path, n: str) -> dict[str, Any]:
    """One ``mllm_rl.run`` of ``model`` on ``backend`` into ``run_dir``, analysed (``n``: i/N)."""
    label = f"{model} {backend}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cmd = run_argv(run_dir, *args.extra, python=python_for(backend, args), backend=backend, plan="rl",
        model=model, steps=args.steps, save_every=args.save_every, max_new_tokens=args.max_new_tokens,
        platform=args.platform)  # fmt: skip
    load0, t0 = load_avg_1m(), time.perf_counter()
    progress(f"  [{n}] {label}: {args.steps} steps ...")
    try:
        run_cmd(cmd, f"run {label}", timeout=args.timeout)
        row = one(label, model, backend, read_run(run_dir), {})
    except (BenchError, ValueError) as e:
        if not args.keep_going:
            raise BenchError(str(e)) from None
        progress(f"  [{n}] {label}: FAILED")
        return {"label": label, "model": model, "backend": backend, "error": str(e)[:3000], "command": cmd}
    dt = time.perf_counter() - t0
    progress(f"  [{n}] {label}: {dt:.0f} s")
    row = {**row, "command": cmd, "run_seconds": round(dt, 2), "load_avg_1m_before": load0,
           "load_avg_1m_after": load_avg_1m(), "run_dir": str(run_dir) if args.runs_dir else None}  # fmt: skip
    return row if args.no_baseline else {**row, **update_over_copy(args, backend, row["analysis"])}


def update_over_copy(args: argparse.Namespace, backend: str, analysis: dict[str, Any]) -> dict[str, Any]:
    """The copy baseline (``bench copy``: h2d of the update's bytes, in the run's interpreter)
    and ``update_weights``'s median rate over it; {} when the run updated nothing."""
    update = next((p for p in analysis["phases"] if p["phase"] == "update_weights"), None)
    if update is None or not update["gbps_median"]:
        return {}
    base = baseline(
        backend, update["bytes_median"], args.platform, 5, args.timeout, python_for(backend, args)
    )
    h2d = base["h2d"]["gbps_best"]
    return {
        "copy_baseline": base,
        "update_gbps_over_h2d": round(update["gbps_median"] / h2d, 4) if h2d else None,
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    if args.from_run:
        runs = [(d, read_run(d)) for d in args.from_run]  # every one validated before any analysis
        labels = [f"{run['model']} {run['backend']}" for _, run in runs]
        for (d, run), label in zip(runs, labels, strict=True):
            if labels.count(label) > 1:  # the same model and backend twice: tell them apart
                label = f"{label} ({d.name})"
            extra = {"run_dir": str(d), "run_seconds": None}
            rows.append(one(label, run["model"], run["backend"], run, extra))
    else:
        plan = [(m, b) for m in args.models for b in args.backends]
        for b in args.backends:
            python_for(b, args)  # bad --python-* before anything runs
        with tempfile.TemporaryDirectory() as tmp:
            for i, (model, backend) in enumerate(plan):
                run_dir = (args.runs_dir or Path(tmp)) / f"{Path(model).name}-{backend}"
                rows.append(new_run(args, model, backend, run_dir, f"{i + 1}/{len(plan)}"))
    given = {
        k: None if args.from_run else getattr(args, k) for k in ("steps", "save_every", "max_new_tokens")
    }
    return bench_json("step_cost", args, **given, extra=list(args.extra), runs=rows)


# -- report --------------------------------------------------------------------------------
def _pct(x: float | None) -> str | None:
    return None if x is None else f"{100 * x:.1f}%"


def report(out: dict[str, Any]) -> str:
    ok = [r for r in out["runs"] if "analysis" in r]
    names = merge_orders([[p["phase"] for p in r["analysis"]["phases"]] for r in ok])
    if BETWEEN in names:  # last, next to the summary rows
        names.remove(BETWEEN)
        names.append(BETWEEN)
    by = [{p["phase"]: p for p in r["analysis"]["phases"]} for r in ok]
    a = [r["analysis"] for r in ok]
    cols = [("phase", "phase", "")] + [(str(i), r["label"], "") for i, r in enumerate(ok)]

    def row(name: str, cell: Any, of: list[Any]) -> dict[str, Any]:
        return {"phase": name, **{str(i): cell(x) for i, x in enumerate(of)}}

    def secs(p: dict[str, Any] | None, n: str) -> str | None:
        if p is None:
            return None
        copies = p["gbps_median"] is not None and not n.startswith("release")  # a release frees
        return f"{p['seconds_median']:.3f}" + (f" ({p['gbps_median']:.3f} GB/s)" if copies else "")

    share_rows = [row(n, lambda b, n=n: _pct(b[n]["share_median"]) if n in b else None, by) for n in names]
    share_rows += [row(OTHER, lambda x: _pct(x["other_share_median"]), a),
                   row("  same, over all counted steps (time-weighted)", lambda x: _pct(x["other_share_total"]), a)]  # fmt: skip
    if any(x.get("other_share_at_cadence") is not None for x in a):
        share_rows.append(row(f"  same, a checkpoint every {RUN_CADENCE} steps",
                              lambda x: _pct(x.get("other_share_at_cadence")), a))  # fmt: skip
    sec_rows = [row(n, lambda b, n=n: secs(b.get(n), n), by) for n in names]
    sec_rows += [row(OTHER, lambda x: f"{x['other_s_median']:.3f}", a),
                 row("step (median)", lambda x: f"{x['step_s_median']:.3f}", a),
                 row("first step (compiles)", lambda x: f"{x['first_step_s']:.3f}" if x["first_step_s"] else None, a)]  # fmt: skip
    steps_counted = {r["label"]: r["analysis"]["steps_counted"] for r in ok}
    lines = ["step cost: share of each phase in the step's wall time (median over the steps after the first; "
             f"steps counted: {steps_counted})", table(share_rows, cols), "",
             "median seconds per phase (rate where the phase copies bytes: bytes moved / seconds)",
             table(sec_rows, cols)]  # fmt: skip
    for r in ok:
        if u := r["analysis"]["update"]:
            lines.append(
                f"{r['label']}: update_weights {u['phase_s_median']:.3f} s, of which the engine's install "
                f"{u['install_s_median']:.3f} s; around it (export, fingerprints) "
                f"{_pct(u['around_install_share_median'])}; full updates {u['full_updates']}/{u['updates']}; "
                f"checkpoints saved in counted steps {r['analysis']['checkpoints_saved']}"
            )
        if (ratio := r.get("update_gbps_over_h2d")) is not None:
            b = r["copy_baseline"]
            lines.append(f"{r['label']}: update_weights at {ratio:.3f}x the copy baseline's h2d "
                         f"({b['h2d']['gbps_best']:.3f} GB/s best of 5, {b['bytes'] / MiB:.0f} MiB, "
                         f"{b['runtime']} {b['platform']}; measured after the run)")  # fmt: skip
        if r.get("run_seconds") is not None:
            lines.append(f"{r['label']}: run {r['run_seconds']:.0f} s, load average (1 min) "
                         f"{r.get('load_avg_1m_before')} -> {r.get('load_avg_1m_after')}")  # fmt: skip
    lines += [f"{r['label']}: FAILED: {r['error'].splitlines()[0]}" for r in out["runs"] if "error" in r]
    return "\n".join(lines)


def summary(out: dict[str, Any]) -> dict[str, Any]:
    keys = ("step_s_median", "other_share_median", "other_share_at_cadence", "other_share_total")
    return {"bench": "step_cost", "runs": [
        {"label": r["label"], **{k: r["analysis"][k] for k in keys}} if "analysis" in r
        else {"label": r["label"], "error": r["error"].splitlines()[0]} for r in out["runs"]]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = doc_parser(__doc__)
    ap.add_argument(
        "--models",
        type=csv_list(what="presets or checkpoint dirs"),
        default=["tiny", "qwen3-0.6b"],
        help="presets or checkpoint dirs, comma-separated (default: tiny,qwen3-0.6b)",
    )
    ap.add_argument("--backends", type=csv_choice(BACKENDS), default=list(BACKENDS), help="comma-separated")
    ap.add_argument(
        "--steps",
        type=positive(int, 2, " (the first step compiles and is left out)"),
        default=4,
        help="RL steps per run (>= 2; the first is left out; default 4)",
    )
    ap.add_argument(
        "--save-every",
        type=positive(int, 0),
        default=1,
        help="checkpoint every N steps; 0 = never (default 1)",
    )
    ap.add_argument(
        "--max-new-tokens", type=positive(int), default=8, help="tokens per completion (default 8)"
    )
    ap.add_argument("--platform", default="auto", choices=["auto", "cpu", "gpu", "cuda", "tpu"])
    for b in BACKENDS:
        ap.add_argument(
            f"--python-{b}", default=None, help=f"interpreter for the {b} runs (default: .venv-{b})"
        )
    ap.add_argument(
        "--from-run",
        type=Path,
        action="append",
        default=[],
        metavar="DIR",
        help="read a recorded run instead of running (repeatable; --models/--backends are ignored)",
    )
    ap.add_argument("--runs-dir", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    ap.add_argument("--keep-going", action="store_true", help="report a failing run and go on")
    ap.add_argument("--no-baseline", action="store_true", help="skip the copy baseline after each run")
    output_flags(ap, extra="extra args for every mllm_rl.run (after --)")
    return run_bench(bench, ap.parse_args(argv), report, summary)[0]

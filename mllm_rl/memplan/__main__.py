"""``python -m mllm_rl.memplan``: will a colocated RL step fit a target, phase by phase? (docs/PLAN.md)

Compiles the backend's step functions for the target (no device needed) and prints the plan
(``--out``: ``plan.json``/``.txt``/``.html``). Exit 0 fits, 6 does not, 2 bad input, 1 unexpected."""

from __future__ import annotations

import argparse
import dataclasses
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any

EXIT_OK, EXIT_ERROR, EXIT_BAD_INPUT, EXIT_DOES_NOT_FIT = 0, 1, 2, 6


# this command's defaults of the run's settings: a real model at a real size
MEMPLAN_DEFAULTS = {"backend": "jax", "model": "qwen3-4b", "micro_batch_size": 4, "prompts_per_step": 8}
# PlanRequest fields read from a setting of another name
REQUEST_ARGS = {
    "micro_batch": "micro_batch_size",
    "prompts": "prompts_per_step",
    "kv_tokens": "max_total_tokens",
}
# PlanRequest fields whose flag is not ``--`` + the field with dashes (messages name the flag)
REQUEST_FLAGS = {
    "micro_batch": "--micro-batch-size",
    "prompts": "--prompts-per-step",
    "kv_tokens": "--kv-tokens",
    "kl": "--kl-beta",
    "options": "--model-option",
    "param_dtype": "--model's torch_dtype",
}


def build_parser() -> argparse.ArgumentParser:
    """The run's settings a plan reads (scope ``memplan``) and the plan's own: target, --fit, --out."""
    from mllm_rl.memplan.planner import FIT_KNOBS
    from mllm_rl.options.cli import add_options

    ap = argparse.ArgumentParser(
        prog="python -m mllm_rl.memplan",
        description="PREDICTED per-device memory of every phase of a colocated RL step on a target "
        "(compiled for the target, nothing runs on it). Exit 0 fits, 6 does not fit, 2 bad input. "
        "The run's settings have the names of python -m mllm_rl.run.",
        epilog="What a plan compiles or traces is kept for the next plan of the same request by the same "
        "code and frameworks: MLLM_RL_PLAN_CACHE=DIR (default $MLLM_RL_CACHE/plans; empty: off).",
    )
    ap.add_argument("--target", default="v4-8", help="device topology (--list-targets) (default: v4-8)")
    ap.add_argument("--list-targets", action="store_true", help="print the backend's targets and exit")
    add_options(ap, ("memplan",), MEMPLAN_DEFAULTS)
    ap.add_argument(
        "--fit",
        nargs="?",
        const="micro_batch",
        choices=["kv", *FIT_KNOBS],
        default=None,
        help="kv: the largest KV pool next to everything else; micro_batch / seq_len: the largest "
        "value that fits (doubling, then bisection; one compile per probe), then the largest KV pool",
    )
    ap.add_argument("--out", type=Path, default=None, help="write plan.json, plan.txt, plan.html here")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags with this command's defaults filled in; every value checked (``ValueError``)."""
    from mllm_rl.options.cli import check_values, parse

    args, _ = parse(build_parser(), argv, ("memplan",), MEMPLAN_DEFAULTS)
    check_values(args, "memplan")
    return args


def flag_names(message: str) -> str:
    """A ``PlanRequest.field`` in a message, as the flag the user typed."""
    return re.sub(
        r"PlanRequest\.(\w+)", lambda m: REQUEST_FLAGS.get(m[1], "--" + m[1].replace("_", "-")), message
    )


def load_model(spec: str) -> Any:
    from mllm_rl.checkpoint.hf_config import config_from_dir
    from mllm_rl.presets import PRESETS, get_preset

    if spec in PRESETS:
        return get_preset(spec)
    path = Path(spec).expanduser()
    if path.is_dir():
        return config_from_dir(path)
    raise ValueError(f"--model {spec!r}: neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")


def make_request(args: argparse.Namespace) -> Any:
    from mllm_rl.memplan.request import PlanRequest
    from mllm_rl.options.check import parse_key_value

    options = dict(parse_key_value(o, "--model-option") for o in args.model_option or [])
    model = load_model(args.model)
    names = {f.name: REQUEST_ARGS.get(f.name, f.name) for f in dataclasses.fields(PlanRequest)}
    kw = {f: getattr(args, a) for f, a in names.items() if hasattr(args, a)}
    kw.update(model=model, kl=args.kl_beta > 0, param_dtype=model.torch_dtype, options=options)
    return PlanRequest(**kw)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_fit(
    planner: Any, req: Any, knob: str, cap: int | None, step: int | None, check_weights: bool
) -> tuple[Any, Any, list[Any]]:
    """The request and measurement of the largest ``knob`` that fits, and the probes (``ValueError``:
    not even the smallest)."""
    from mllm_rl.memplan.planner import FIT_KNOBS, Probe, fits_without_kv, plans, search

    step = step or FIT_KNOBS[knob]
    if step < 1:
        raise ValueError(f"--fit-step must be >= 1, got {step}")
    cap = cap or {"micro_batch": 256, "seq_len": 131072}[knob]
    found: dict[int, tuple[Any, Any]] = {}

    def fits(v: int) -> Probe:
        r = dataclasses.replace(req, **{knob: v})
        t0 = time.perf_counter()
        m = planner.measure(r)
        plan = plans(m, r, check_weights)[r.schedule]
        ok, detail = fits_without_kv(plan)
        found[v] = (r, m)
        return Probe(v, ok, f"{detail} ({time.perf_counter() - t0:.0f} s)")

    def show(p: Any) -> None:
        _say(f"[fit] {knob}={p.value}: {'fits' if p.fits else 'does not fit'}: {p.detail}")

    best, probes = search(fits, getattr(req, knob), step, cap, show)
    if best is None:
        raise ValueError(
            f"{req.model.name} does not fit {req.target} even at {knob}={step}: {probes[-1].detail}"
        )
    r, m = found[best]
    return r, m, probes


def main(argv: list[str] | None = None) -> int:
    t_start = time.perf_counter()
    try:
        args = parse_args(argv)
        if args.out is not None:  # before any compile: plan.json & co. must be writable there
            from mllm_rl.options.check import check_output_dir

            check_output_dir(args.out, "--out")
        from mllm_rl.memplan.planner import load_planner

        planner = load_planner(args.backend)
        if args.list_targets:
            for name, desc in getattr(planner, "targets", dict)().items():
                print(f"{name:10s} {desc}")
            return EXIT_OK
        known = getattr(planner, "targets", None)
        if known is not None and args.target not in known():
            raise ValueError(
                f"--target {args.target!r}: unknown for --backend {args.backend}; "
                f"choose one of {', '.join(known())}"
            )
        req = make_request(args)
        check = getattr(planner, "check", None)
        if check is not None:  # a refusal is one line: before the first line of progress or a compiler
            check(req)
        return _plan(planner, req, args, t_start)
    except ValueError as e:
        _say(f"error: {flag_names(str(e))}")
        return EXIT_BAD_INPUT


def _plan(planner: Any, req: Any, args: argparse.Namespace, t_start: float) -> int:
    from mllm_rl.memplan import output
    from mllm_rl.memplan.planner import fit_kv, plans

    _say(f"[plan] {req.backend} {req.model.name} on {req.target}: compiling the step functions ...")
    extra: dict[str, Any] = {}
    if args.fit and args.fit != "kv":
        req, m, probes = run_fit(planner, req, args.fit, args.fit_max, args.fit_step, args.check_weights)
        extra["fit"] = {
            "knob": args.fit,
            "value": getattr(req, args.fit),
            "probes": [dataclasses.asdict(p) for p in probes],
        }
    else:
        m = planner.measure(req)
    if args.fit:
        m, req, tokens, phase = fit_kv(m, req, args.check_weights)
        if tokens < 1:
            raise ValueError(
                f"no room for a KV pool in {phase} (micro-batch {req.micro_batch} x {req.seq_len})"
            )
        extra["kv_fit"] = {"tokens": tokens, "tightest_phase": phase}
    result = plans(m, req, args.check_weights)
    summary = _summary(result, m, req, extra, t_start)
    text = output.render(result, m, summary)
    print(text, end="")
    if args.out is not None:
        files = output.write(args.out, text, output.document(result, m, summary, extra))
        _say("[plan] wrote " + ", ".join(str(f) for f in files))
    run_plan = result[req.schedule]
    return EXIT_OK if run_plan.fits else EXIT_DOES_NOT_FIT


def _summary(result: dict[str, Any], m: Any, req: Any, extra: dict[str, Any], t_start: float) -> list[str]:
    from mllm_rl.memplan.compose import GIB
    from mllm_rl.memplan.output import verdict

    lines = [verdict(p) for p in result.values()]
    info = m.info
    if "kv_tokens" in info:
        seqs = info["kv_tokens"] // req.seq_len
        line = f"KV pool: {info['kv_tokens']} tokens per engine ({seqs} sequences of {req.seq_len} at once"
        line += f"; a step's rollout is {req.prompts * req.group_size})"
        if "mem_fraction_static" in info:
            line += f"; pass max_total_tokens={info['kv_tokens']} with mem_fraction_static={info['mem_fraction_static']}"
        lines.append(line)
    if "kv_fit" in extra:
        lines.append(f"KV pool fitted to the room left in {extra['kv_fit']['tightest_phase']}")
    if "fit" in extra:
        lines.append(
            f"fit: largest {extra['fit']['knob']} = {extra['fit']['value']} ({len(extra['fit']['probes'])} probes)"
        )
    secs = info.get("compile_seconds", {})
    rss = max(info.get("host_peak_rss_bytes", 0), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    lines.append(
        f"compile: {sum(secs.values()):.1f} s ({', '.join(f'{k} {v:.1f} s' for k, v in secs.items())}); "
        f"plan wall time {time.perf_counter() - t_start:.1f} s; host peak RSS {rss / GIB:.2f} GiB"
    )
    return lines


if __name__ == "__main__":
    sys.exit(main())

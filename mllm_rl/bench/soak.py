"""Soak: N release/resume/update cycles of one rollout engine in one process; nothing may drift.

    python -m mllm_rl.bench soak --backend jax|torch --preset tiny --cycles 100 [--cpu-backup] [--trainer] [--json OUT]

One ``ManagedEngine`` (and, with ``--trainer``, the backend's trainer) in this process. Each cycle
does what a colocated RL step does to the engine: drain, release KV cache and weights, [trainer
onload/offload,] resume the weights, a full update (every ``--update-every`` cycles with
``--cpu-backup``), resume the KV cache, continue, a greedy probe. Checked every cycle: device
memory back at baseline within ``--device-tol-mib``, releases freeing >= 99% of the tags' bytes,
greedy tokens identical, host RSS within ``--rss-tol-mib`` after ``--warmup`` cycles.

Exit 0 when every target holds, 1 when one fails, 2 on bad input.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from mllm_rl.bench import MiB
from mllm_rl.bench.cli import bench_parser, main_with_child, output_flags, pick, positive, progress, target
from mllm_rl.bench.engine import load, start_engine
from mllm_rl.bench.machine import bench_json
from mllm_rl.bench.tables import target_lines

PROMPTS = [[51, 71, 68, 220, 66, 64, 79], [64, 65, 66, 64, 65, 66, 64]]
HARD_EXIT = True  # the driver leaves without interpreter teardown (an engine's threads abort it)


def _slope(ys: list[int]) -> float | None:
    """Least-squares slope of ``ys`` against 0..n-1 (bytes per cycle); None under two points."""
    return statistics.linear_regression(range(len(ys)), ys).slope if len(ys) > 1 else None


def soak(args: argparse.Namespace) -> dict[str, Any]:
    from mllm_rl.engine import SamplingParams
    from mllm_rl.phases.probe import host_rss
    from mllm_rl.trainer import OPTIMIZER, PARAMS, TrainConfig

    backend, model, runtime = load(args)
    probe = backend.memory_probe()
    snap = probe.snapshot()
    sources = [f"{d.id}:{d.source}" for d in snap]
    truth_idx = [i for i, d in enumerate(snap) if d.source != "torch_allocator"]
    engine, full = start_engine(backend, model, weights_cpu_backup=args.cpu_backup,
                                max_total_tokens=args.max_total_tokens, context_length=args.context_length)  # fmt: skip
    trainer = backend.create_trainer(model, TrainConfig()) if args.trainer else None
    export = full if trainer is None else lambda: trainer.export_weights(full=True)

    engine.update_weights(export())
    if trainer is not None:
        trainer.offload([PARAMS, OPTIMIZER])
    backend.empty_cache()
    greedy = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)
    ref = engine.generate(PROMPTS, greedy)
    ref_tokens = [o.token_ids for o in ref]
    weight_bytes = engine.weight_bytes()
    base_dev = probe.in_use()
    base_rss = host_rss()
    every = args.update_every or (2 if args.cpu_backup else 1)
    cycles: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    for i in range(args.cycles):
        t0 = time.perf_counter()
        engine.drain()
        used0 = [probe.in_use()[j] for j in truth_idx]
        held = sum(engine.release(["kv_cache", "weights"]).values())
        used1 = [probe.in_use()[j] for j in truth_idx]
        freed = sum(a - b for a, b in zip(used0, used1, strict=True) if a is not None and b is not None)
        if trainer is not None:
            trainer.onload([PARAMS, OPTIMIZER])
            trainer.offload([OPTIMIZER])
        backend.empty_cache()
        engine.resume(["weights"])
        updated = not engine.weights_valid or i % every == 0
        if updated:
            engine.update_weights(export())
        if trainer is not None:
            trainer.offload([PARAMS])
        backend.empty_cache()
        engine.resume(["kv_cache"])
        engine.continue_generation()
        outs = engine.generate(PROMPTS, greedy)
        dev = probe.in_use()
        rss = host_rss()
        diffs = (abs(a - b) for o, r in zip(outs, ref, strict=True) for a, b in zip(o.logprobs, r.logprobs, strict=False))  # fmt: skip
        cycles.append(c := {"cycle": i, "seconds": round(time.perf_counter() - t0, 4), "updated": updated,
            "tokens_identical": [o.token_ids for o in outs] == ref_tokens, "logprob_max_abs_diff": max(diffs, default=0.0),
            "device_dev_bytes": [None if a is None or b is None else a - b for a, b in zip(dev, base_dev, strict=True)],
            "freed_over_held": round(freed / held, 5) if held else None, "rss_bytes": rss,
            "tokens": [o.token_ids for o in outs] if args.per_cycle else None})  # fmt: skip
        if args.verbose:
            progress(f"cycle {i}: {c['seconds']:.2f}s dev {c['device_dev_bytes']} rss {rss / MiB:.1f} MiB "
                     f"tokens {'ok' if c['tokens_identical'] else 'DIFFER'}")  # fmt: skip
    total_s = time.perf_counter() - t_start
    engine.shutdown()

    dev_dev = [
        max((abs(c["device_dev_bytes"][j] or 0) for c in cycles), default=0) for j in range(len(base_dev))
    ]
    truth_dev = max((dev_dev[j] for j in truth_idx), default=0)
    warm = min(args.warmup, max(0, len(cycles) - 1))
    rss_ref = cycles[warm - 1]["rss_bytes"] if warm > 0 else base_rss
    rss_after = [c["rss_bytes"] for c in cycles[warm:]]
    rss_dev = max((abs(r - rss_ref) for r in rss_after), default=0)
    slope = _slope(rss_after)
    mismatches = [c["cycle"] for c in cycles if not c["tokens_identical"]]
    freed_min = min((c["freed_over_held"] for c in cycles if c["freed_over_held"] is not None), default=None)
    targets = {
        "device_back_to_baseline_bytes": target(truth_dev, "<=", args.device_tol_mib * MiB),
        "release_freed_over_held": target(freed_min, ">=", 0.99),
        "greedy_identical_cycles": target(len(cycles) - len(mismatches), "==", len(cycles)),
        "host_rss_deviation_bytes": target(rss_dev, "<=", args.rss_tol_mib * MiB),
    }
    return bench_json("soak", args, ("backend", "preset"), platform=runtime.get("platform"),
        engine=type(engine.engine).__name__, trainer=args.trainer, weights_cpu_backup=args.cpu_backup,
        update_every=every, cycles=len(cycles), warmup=warm, probe_sources=sources,
        weight_bytes=weight_bytes, baseline_device_bytes=base_dev, baseline_rss_bytes=base_rss,
        rss_ref_bytes=rss_ref, device_max_abs_dev_bytes=dev_dev, rss_max_abs_dev_bytes=rss_dev,
        rss_slope_bytes_per_cycle=round(slope, 1) if slope is not None else None,
        rss_first_last_bytes=[cycles[0]["rss_bytes"], cycles[-1]["rss_bytes"]] if cycles else None,
        logprob_max_abs_diff=max((c["logprob_max_abs_diff"] for c in cycles), default=0.0),
        token_mismatch_count=len(mismatches), token_mismatch_cycles=mismatches[:50],
        reference_tokens=ref_tokens, freed_over_held_min=freed_min,
        cycle_seconds_median=round(statistics.median(c["seconds"] for c in cycles), 4) if cycles else None,
        total_seconds=round(total_s, 2), targets=targets, per_cycle=cycles if args.per_cycle else None)  # fmt: skip


def report(out: dict[str, Any]) -> str:
    lines = [
        f"soak {out['backend']} {out['preset']} on {out['platform']} ({out['engine']}"
        f"{', trainer' if out['trainer'] else ''}, cpu backup {out['weights_cpu_backup']}, update every "
        f"{out['update_every']}): {out['cycles']} cycles in {out['total_seconds']:.1f} s "
        f"(median {out['cycle_seconds_median']} s/cycle)",
        f"device: max |bytes in use - baseline| per probe entry {out['device_max_abs_dev_bytes']} B "
        f"({', '.join(out['probe_sources'])}); release freed >= {out['freed_over_held_min']} of held",
        f"greedy: {out['cycles'] - out['token_mismatch_count']}/{out['cycles']} cycles identical tokens "
        f"(first differing: {out['token_mismatch_cycles'][:10]}); "
        f"max |logprob - baseline| {out['logprob_max_abs_diff']:.3g}",
        f"host RSS: max |RSS - RSS after {out['warmup']} warm-up cycles| {out['rss_max_abs_dev_bytes'] / MiB:.2f} MiB, "
        f"slope {(out['rss_slope_bytes_per_cycle'] or 0) / 1024:.1f} KiB/cycle, first/last "
        f"{[round(x / MiB, 1) for x in out['rss_first_last_bytes'] or []]} MiB",
    ]
    return "\n".join(lines + target_lines(out["targets"]))


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, backend=None)
    # fmt: off
    ap.add_argument("--cycles", type=positive(int), default=100)
    ap.add_argument("--cpu-backup", action="store_true", help="engine keeps a host copy of its weights")
    ap.add_argument("--update-every", type=positive(int), default=None,
                    help="full update every N cycles when the weights are still valid (default 1; 2 with --cpu-backup)")
    ap.add_argument("--trainer", action="store_true", help="also cycle the trainer (onload/offload, export)")
    ap.add_argument("--max-total-tokens", type=positive(int), default=4096, help="engine KV cache, tokens")
    ap.add_argument("--context-length", type=positive(int), default=512)
    ap.add_argument("--max-new-tokens", type=positive(int), default=8, help="greedy probe length")
    ap.add_argument("--warmup", type=int, default=3, help="cycles before the RSS reference is taken")
    ap.add_argument("--device-tol-mib", type=positive(float), default=1.0)
    ap.add_argument("--rss-tol-mib", type=positive(float), default=64.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--per-cycle", action="store_true", help="include every cycle's numbers in the JSON")
    ap.add_argument("--verbose", action="store_true", help="one line per cycle on stderr")
    # fmt: on
    output_flags(ap, timeout=None)
    args = ap.parse_args(argv)
    if args.warmup < 0:
        print(f"error: --warmup must be >= 0, got {args.warmup}", file=sys.stderr)
        return 2
    args.platform = "gpu" if args.platform == "cuda" else args.platform
    keys = ("bench", "backend", "preset", "cycles", "targets")
    return main_with_child(args, None, soak, report, lambda o: pick(o, keys), strict=True)

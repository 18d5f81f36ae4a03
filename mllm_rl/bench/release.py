"""Measure release/resume of a rollout engine's memory tags against a raw copy of the same bytes.

    python -m mllm_rl.bench release --backend torch|jax --preset qwen3-4b [--platform cuda] [--cpu-backup]
        [--cycles 3] [--json OUT]

One engine in this process, ``--cycles`` times: release ``kv_cache`` and ``weights``, resume them,
re-sync the weights when no CPU backup kept them. Per tag: device bytes freed / held (min over
cycles; target >= 0.99), the same on resume, and the median release / resume seconds next to a raw
copy of those bytes (on-device, or D2H / H2D with a CPU backup); greedy output before vs after.
Exit 0 with results (``--strict``: 1 when a target fails), 2 on bad input.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from mllm_rl.bench import MiB
from mllm_rl.bench.cli import bench_parser, main_with_child, output_flags, positive, target
from mllm_rl.bench.engine import load, start_engine
from mllm_rl.bench.machine import bench_json
from mllm_rl.bench.tables import VERDICT, table

FREED_TARGET = 0.99
TAGS = ("kv_cache", "weights")
HARD_EXIT = True  # the driver leaves without interpreter teardown (an engine's threads abort it)


def memcpy_baselines(
    backend_name: str, platform: str, nbytes: int, repeats: int, cpu_backup: bool
) -> dict[str, Any]:
    """Seconds of a raw copy of ``nbytes``: on-device (d2d) always, d2h/h2d with a CPU backup."""
    from mllm_rl.bench.copy_bandwidth import jax_copy_bandwidth, torch_copy_bandwidth

    kinds = ("d2d", "d2h", "h2d") if cpu_backup else ("d2d",)
    if backend_name == "jax":
        bw = jax_copy_bandwidth(nbytes, repeats, kinds)
    else:
        bw = torch_copy_bandwidth(nbytes, "cpu" if platform == "cpu" else "auto", repeats, kinds)
    return {k: bw[k]["seconds_median"] for k in kinds}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from mllm_rl.engine import SamplingParams

    backend, model, runtime = load(args)
    probe = backend.memory_probe()
    truth = lambda: probe.in_use()[0]  # noqa: E731
    source = probe.snapshot()[0].source
    engine, full = start_engine(backend, model, weights_cpu_backup=args.cpu_backup, engine=args.engine or "auto",
                                max_total_tokens=args.max_total_tokens or None)  # fmt: skip
    engine.update_weights(full())
    prompt, greedy = [[51, 71, 68, 220, 66, 64, 79]], SamplingParams(max_new_tokens=8)
    before = engine.generate(prompt, greedy)[0].token_ids
    per: dict[str, dict[str, list[Any]]] = {t: {k: [] for k in ("held", "freed", "rel", "res", "back", "recl")} for t in TAGS}  # fmt: skip
    resync: list[float] = []
    for _ in range(args.cycles):
        engine.drain()
        for tag in TAGS:
            used0, t0 = truth(), time.perf_counter()
            per[tag]["held"].append(engine.release([tag])[tag])
            per[tag]["rel"].append(time.perf_counter() - t0)
            per[tag]["freed"].append(used0 - truth())
        for tag in reversed(TAGS):
            used0, t0 = truth(), time.perf_counter()
            per[tag]["back"].append(engine.resume([tag])[tag])
            per[tag]["res"].append(time.perf_counter() - t0)
            per[tag]["recl"].append(truth() - used0)
        t0 = time.perf_counter()
        if not engine.state()["weights_valid"]:
            engine.update_weights(full())
        resync.append(time.perf_counter() - t0)
        engine.continue_generation()
    after = engine.generate(prompt, greedy)[0].token_ids
    mode = getattr(getattr(engine.engine, "memory", None), "mode", None)
    engine_name = type(engine.engine).__name__
    bases: dict[str, dict[str, Any]] = {}
    for tag in TAGS:  # before shutdown: an sglang-jax shutdown kills this process's children
        try:
            bases[tag] = memcpy_baselines(args.backend, runtime.get("platform", "cpu"), per[tag]["held"][0],
                                          args.repeats, args.cpu_backup)  # fmt: skip
        except Exception as e:  # e.g. no room for two more copies next to the engine: report, go on
            bases[tag] = {"error": f"{type(e).__name__}: {e}"[:300]}
    engine.shutdown()
    tags: dict[str, dict[str, Any]] = {}
    targets: dict[str, Any] = {}
    for tag in TAGS:
        p = per[tag]
        held = p["held"][0]
        base = bases[tag]
        backed = args.cpu_backup and tag == "weights"
        rel_base, res_base = base.get("d2h" if backed else "d2d"), base.get("h2d" if backed else "d2d")
        rel, res = statistics.median(p["rel"]), statistics.median(p["res"])
        frac = min(f / h for f, h in zip(p["freed"], p["held"], strict=True)) if held else None
        recl = min(r / h for r, h in zip(p["recl"], p["held"], strict=True)) if held else None
        tags[tag] = {"held_bytes": held, "freed_bytes": min(p["freed"]),
            "freed_frac": round(frac, 4) if frac is not None else None, "reclaimed_bytes": min(p["recl"]),
            "reclaimed_frac": round(recl, 4) if recl is not None else None, "back_bytes": p["back"][0],
            "release_s": round(rel, 5), "resume_s": round(res, 5),
            "release_baseline": "d2h" if backed else "d2d", "resume_baseline": "h2d" if backed else "d2d",
            "release_baseline_s": round(rel_base, 5) if rel_base else None,
            "resume_baseline_s": round(res_base, 5) if res_base else None,
            "baseline_error": base.get("error"),
            "release_over_memcpy": round(rel / rel_base, 3) if rel_base else None,
            "resume_over_memcpy": round(res / res_base, 3) if res_base else None,
            "release_s_all": [round(x, 5) for x in p["rel"]],
            "resume_s_all": [round(x, 5) for x in p["res"]]}  # fmt: skip
        targets[f"{tag}_freed_frac"] = target(tags[tag]["freed_frac"], ">=", FREED_TARGET)
        targets[f"{tag}_reclaimed_frac"] = target(tags[tag]["reclaimed_frac"], ">=", FREED_TARGET)
    targets["greedy_identical"] = target(after == before, "==", True)
    return bench_json("release", args, ("backend", "preset"), platform=runtime.get("platform"),
        source=source, engine=engine_name, memory_mode=mode, weights_cpu_backup=args.cpu_backup,
        cycles=args.cycles, tags=tags, resync_s=round(statistics.median(resync), 4),
        greedy_identical=after == before, targets=targets)  # fmt: skip


def report(out: dict[str, Any]) -> str:
    cols = [("tag", "tag", ""), ("held_mib", "held MiB", ".1f"), ("freed_frac", "freed/held", ".4f"),
        ("reclaimed_frac", "reclaimed/held", ".4f"), ("release_ms", "release ms", ".2f"),
        ("release_baseline", "vs", ""), ("release_over_memcpy", "x memcpy", ".3f"),
        ("resume_ms", "resume ms", ".2f"), ("resume_baseline", "vs", ""),
        ("resume_over_memcpy", "x memcpy", ".3f")]  # fmt: skip
    rows = [{"tag": t, **v, "held_mib": v["held_bytes"] / MiB, "release_ms": v["release_s"] * 1e3,
             "resume_ms": v["resume_s"] * 1e3} for t, v in out["tags"].items()]  # fmt: skip
    head = (
        f"release/resume {out['backend']} {out['preset']} on {out['platform']} ({out['engine']}, "
        f"{out['memory_mode'] or 'delete/reallocate'}, source {out['source']}, cpu backup "
        f"{out['weights_cpu_backup']}, median of {out['cycles']} cycles)"
    )
    verdicts = ", ".join(f"{k} {VERDICT[t['pass']]}" for k, t in out["targets"].items())
    return "\n".join([head, table(rows, cols), f"re-sync {out['resync_s']:.3f} s; targets: {verdicts}"])


def main(argv: list[str] | None = None) -> int:
    ap = bench_parser(__doc__, backend="torch")
    # fmt: off
    ap.add_argument("--engine", default=None, choices=["embedded", "sglang"], help="torch backend's engine")
    ap.add_argument("--cpu-backup", action="store_true", help="engine keeps a host copy of its weights")
    ap.add_argument("--cycles", type=positive(int), default=3, help="release/resume cycles (times: median)")
    ap.add_argument("--repeats", type=positive(int), default=3, help="timed raw copies per baseline")
    ap.add_argument("--max-total-tokens", type=positive(int), default=None, help="engine KV cache size, tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    # fmt: on
    output_flags(ap, timeout=None)
    args = ap.parse_args(argv)
    args.platform = "gpu" if args.platform == "cuda" else args.platform
    return main_with_child(args, None, bench, report, lambda o: o, strict=args.strict, report_to_stderr=True)

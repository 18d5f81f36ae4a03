"""Measure release/resume of a rollout engine's memory tags; prints one JSON object.

    python scripts/bench_release.py --backend torch --preset qwen3-4b [--platform cuda] [--cpu-backup]

For each tag (``kv_cache``, then ``weights``): bytes the tag holds (``tag_bytes``), bytes the
release freed by device truth (the backend probe's first entry: ``mem_get_info`` on CUDA,
``live_tensors`` on torch CPU, ``live_arrays``/``memory_stats`` on JAX), the same on resume,
and the wall time of each call. The engine is swapped to the checkpoint's weights and drained
first; after the resume a full update (no backup) or nothing (backup) makes it valid again and
a greedy generation is checked against the one before the release.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def bench(backend_name: str, preset: str, platform: str, cpu_backup: bool, seed: int) -> dict[str, Any]:
    from mllm_rl.backend_registry import load_backend
    from mllm_rl.checkpoint.resolve import resolve_model
    from mllm_rl.engine import SamplingParams, WeightExport
    from mllm_rl.engine_state import ManagedEngine

    backend = load_backend(backend_name)
    model = resolve_model(preset, seed=seed)
    runtime = backend.init_runtime(tp=1, platform=platform)
    probe = backend.memory_probe()
    truth = lambda: probe.in_use()[0]  # noqa: E731
    source = probe.snapshot()[0].source
    engine = ManagedEngine(backend.create_engine(model, tp=1, weights_cpu_backup=cpu_backup))
    full = lambda: WeightExport(list(model.tensors), model.iter_tensors(), full=True)  # noqa: E731
    engine.update_weights(full())
    prompt, greedy = [[51, 71, 68, 220, 66, 64, 79]], SamplingParams(max_new_tokens=8)
    before = engine.generate(prompt, greedy)[0].token_ids
    engine.drain()
    tags: dict[str, dict[str, Any]] = {}
    for tag in ("kv_cache", "weights"):
        used0, t0 = truth(), time.perf_counter()
        held = engine.release([tag])[tag]
        t1 = time.perf_counter()
        freed = used0 - truth()
        tags[tag] = {"held_bytes": held, "freed_bytes": freed, "freed_frac": round(freed / held, 4) if held else None,
                     "release_s": round(t1 - t0, 4)}  # fmt: skip
    for tag in ("weights", "kv_cache"):
        used0, t0 = truth(), time.perf_counter()
        back = engine.resume([tag])[tag]
        tags[tag].update(resume_s=round(time.perf_counter() - t0, 4), reclaimed_bytes=truth() - used0, back_bytes=back)
    t0 = time.perf_counter()
    if not engine.state()["weights_valid"]:
        engine.update_weights(full())
    resync_s = round(time.perf_counter() - t0, 4)
    engine.continue_generation()
    after = engine.generate(prompt, greedy)[0].token_ids
    engine.shutdown()
    return {
        "backend": backend_name, "preset": preset, "platform": runtime.get("platform"), "source": source,
        "engine": type(engine.engine).__name__, "memory_mode": getattr(getattr(engine.engine, "memory", None), "mode", None),
        "weights_cpu_backup": cpu_backup, "tags": tags, "resync_s": resync_s, "greedy_identical": after == before,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--preset", default="tiny", help="preset (written once to $MLLM_RL_CACHE) or checkpoint dir")
    ap.add_argument("--platform", default="auto")
    ap.add_argument("--cpu-backup", action="store_true", help="engine keeps a host copy of its weights")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        out = bench(args.backend, args.preset, args.platform, args.cpu_backup, args.seed)
    except ValueError as e:  # bad preset / checkpoint / backend: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # engines with scheduler threads (sglang-jax) abort interpreter teardown

"""Drives a real sglang-jax engine through release/resume in its own process; prints JSON.

    python tests/jax/lifecycle_driver.py CHECKPOINT_DIR

Run as a subprocess by test_engine_memory.py (an engine must not live in pytest's process).
"""

from __future__ import annotations

import json
import os
import sys
import warnings


def main(ckpt: str) -> dict:
    from mllm_rl.backends.jax import JaxBackend
    from mllm_rl.backends.jax.probe import JaxMemoryProbe
    from mllm_rl.checkpoint import ModelDir
    from mllm_rl.engine import EngineStateError, SamplingParams, WeightExport
    from mllm_rl.engine_state import ManagedEngine

    out: dict = {}
    backend = JaxBackend()
    backend.init_runtime(tp=1)
    model = ModelDir.open(ckpt)
    engine = ManagedEngine(backend.create_engine(model, tp=1))
    full = lambda: WeightExport(list(model.tensors), model.iter_tensors(), full=True)  # noqa: E731
    first = lambda: WeightExport.of(list(model.iter_tensors())[:1], full=False)  # noqa: E731
    probe = JaxMemoryProbe()
    used = lambda: probe.in_use()[0]  # noqa: E731
    greedy = SamplingParams(max_new_tokens=8)
    probe_ids = [[51, 71, 68, 220, 66, 64, 79]]
    engine.update_weights(full())
    out["reference"] = engine.generate(probe_ids, greedy)[0].token_ids

    def refused() -> str | None:
        try:
            engine.generate(probe_ids, greedy)
        except EngineStateError as e:
            return str(e)
        return None

    try:
        engine.release(["kv_cache"])
        out["release_undrained"] = None
    except EngineStateError as e:
        out["release_undrained"] = str(e)
    engine.drain()
    for tag in ("kv_cache", "weights"):
        before = used()
        held = engine.release([tag])[tag]
        out[f"{tag}_held"] = held
        out[f"{tag}_freed"] = before - used()
    out["refused_while_released"] = refused()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out["double_release"] = engine.release(["kv_cache"])
        out["double_release_warned"] = any("already released" in str(x.message) for x in w)
    try:
        engine.update_weights(first())
        out["update_while_released"] = None
    except EngineStateError as e:
        out["update_while_released"] = str(e)
    try:
        engine.release(["cuda_graph_x"])
    except ValueError as e:
        out["unknown_tag"] = str(e)
    engine.resume(["kv_cache", "weights"])  # no CPU backup: weights invalid
    engine.continue_generation()
    out["after_resume_bytes_back"] = used()
    out["refused_while_invalid"] = refused()
    try:
        engine.update_weights(first())  # a partial sync on invalid weights is refused
        out["partial_on_invalid"] = None
    except EngineStateError as e:
        out["partial_on_invalid"] = str(e)
    out["refused_after_partial"] = refused()
    try:
        engine.update_weights(WeightExport.of([("model.layers.0.bogus.weight", None)], full=False))
        out["unknown_name"] = None
    except ValueError as e:
        out["unknown_name"] = str(e)
    engine.update_weights(full())
    out["after_full_sync"] = engine.generate(probe_ids, greedy)[0].token_ids
    engine.engine.weights_cpu_backup = True  # now with backup: resume alone restores the weights
    engine.drain()
    engine.release(["weights", "kv_cache"])
    engine.resume(["weights", "kv_cache"])
    engine.continue_generation()
    out["after_backup_resume"] = engine.generate(probe_ids, greedy)[0].token_ids
    for _cycle in range(3):  # step 2+ is where offload bugs show up
        engine.drain()
        engine.release(["kv_cache", "weights"])
        engine.resume(["weights"])
        engine.update_weights(full())
        engine.resume(["kv_cache"])
        engine.continue_generation()
        out.setdefault("cycles", []).append(engine.generate(probe_ids, greedy)[0].token_ids)
    engine.shutdown()
    return out


if __name__ == "__main__":
    result = main(sys.argv[1])
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)

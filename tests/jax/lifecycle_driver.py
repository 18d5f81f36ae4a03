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
    from mllm_rl.backends.jax.sglang_engine import EngineStateError
    from mllm_rl.checkpoint import ModelDir
    from mllm_rl.engine import SamplingParams

    out: dict = {}
    backend = JaxBackend()
    backend.init_runtime(tp=1)
    model = ModelDir.open(ckpt)
    engine = backend.create_engine(model, tp=1)
    probe = JaxMemoryProbe()
    used = lambda: probe.in_use()[0]  # noqa: E731
    greedy = SamplingParams(max_new_tokens=8)
    probe_ids = [[51, 71, 68, 220, 66, 64, 79]]
    engine.update_weights(model.iter_tensors())
    out["reference"] = engine.generate(probe_ids, greedy)[0].token_ids

    def refused() -> str | None:
        try:
            engine.generate(probe_ids, greedy)
        except EngineStateError as e:
            return str(e)
        return None

    engine.pause_generation()
    engine.flush_cache()
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
        engine.update_weights(list(model.iter_tensors())[:1])
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
    first = list(model.iter_tensors())[:1]
    engine.update_weights(first)  # a partial sync must not make them valid
    out["refused_after_partial"] = refused()
    engine.update_weights(model.iter_tensors())
    out["after_full_sync"] = engine.generate(probe_ids, greedy)[0].token_ids
    engine.weights_cpu_backup = True  # now with backup: resume alone restores the weights
    engine.pause_generation()
    engine.flush_cache()
    engine.release(["weights", "kv_cache"])
    engine.resume(["weights", "kv_cache"])
    engine.continue_generation()
    out["after_backup_resume"] = engine.generate(probe_ids, greedy)[0].token_ids
    for _cycle in range(3):  # step 2+ is where offload bugs show up
        engine.pause_generation()
        engine.flush_cache()
        engine.release(["kv_cache", "weights"])
        engine.resume(["weights"])
        engine.update_weights(model.iter_tensors())
        engine.resume(["kv_cache"])
        engine.continue_generation()
        out.setdefault("cycles", []).append(engine.generate(probe_ids, greedy)[0].token_ids)
    engine.shutdown()
    return out


if __name__ == "__main__":
    result = main(sys.argv[1])
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)

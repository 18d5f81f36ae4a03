"""Two tasks' sglang-jax engines in one process (JAX CPU): a release frees exactly one task's bytes
(device truth: live arrays), the other engine's weights and outputs are untouched, and a weight
update sent to one task never changes the other's fingerprint. sglang-jax runs in-process and talks
to its scheduler over IPC files (``PortArgs.init_new`` without ``nnodes``), so two engines started
one after the other in the same process share no port; an engine's shutdown removes them.

The engines run in a subprocess (an sglang-jax engine must not live in pytest's process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

SCRIPT = """
import json, os, sys
import numpy as np
from mllm_rl.backend_registry import load_backend
from mllm_rl.checkpoint import ModelDir
from mllm_rl.engine import EngineOptions, SamplingParams, WeightExport
from mllm_rl.engine_state import ManagedEngine

backend = load_backend("jax")
backend.init_runtime(platform="cpu")
probe = backend.memory_probe()
total = lambda: sum(probe.in_use())
model = ModelDir.open(sys.argv[1])
kw = dict(context_length=64, max_total_tokens=512, max_running_requests=4)
a = ManagedEngine(backend.create_engine(model, EngineOptions(task="a", **kw)))
b = ManagedEngine(backend.create_engine(model, EngineOptions(task="b", **kw)))
for e in (a, b):
    e.update_weights(WeightExport(list(model.tensors), model.iter_tensors(), full=True))
greedy = SamplingParams(max_new_tokens=6)
prompts = [[51, 71, 68, 220, 66], [160, 121, 254, 162]]
out = {"names": [a.engine.memory_tag(t) for t in ("weights", "kv_cache")]}
fp_b0 = b.weights_fingerprint()
gen_b0 = [o.token_ids for o in b.generate(prompts, greedy)]
before = total()
a.drain()
held = a.release(["weights", "kv_cache"])
after = total()
out.update(held=held, freed=before - after, b_fp_same=b.weights_fingerprint() == fp_b0,
           b_gen_same=[o.token_ids for o in b.generate(prompts, greedy)] == gen_b0)
a.resume(["weights", "kv_cache"])
out["back"] = total() - after
rng = np.random.default_rng(0)
new = [(n, rng.standard_normal(model.tensors[n][1].shape).astype(np.float32)) for n in model.tensors]
a.update_weights(WeightExport.of(new, full=True))
fp_a = a.weights_fingerprint()
out.update(b_fp_same_after_update=b.weights_fingerprint() == fp_b0,
           a_changed=fp_a != fp_b0, a_is_sent=all(abs(fp_a[n][1] - float((x.astype(np.float64) ** 2).sum()))
                                                  < 1e-3 * fp_a[n][1] for n, x in new))
ipc = [v[len("ipc://"):] for v in vars(a.engine.engine.port_args).values()
       if isinstance(v, str) and v.startswith("ipc://")]
out["ipc_there"] = [os.path.exists(p) for p in ipc]
a.shutdown()  # sglang-jax leaves its IPC files; the adapter removes them
out["ipc_left"] = [p for p in ipc if os.path.lexists(p)]
print("RESULT " + json.dumps(out), flush=True)
os._exit(0)
"""


def test_two_engines_release_and_update_only_their_own_weights(tiny_ckpt):
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_ckpt)], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    out = json.loads(lines[0][len("RESULT ") :])
    assert out["names"] == ["a/weights", "a/kv_cache"]
    assert out["freed"] == sum(out["held"].values()) > 0  # device truth: exactly a's bytes
    assert out["back"] == out["freed"]
    assert out["b_fp_same"] and out["b_gen_same"]
    assert out["b_fp_same_after_update"] and out["a_changed"] and out["a_is_sent"]
    assert out["ipc_there"] == [True] * 5 and out["ipc_left"] == []  # nothing left in the temp dir

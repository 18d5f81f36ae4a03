"""torch_memory_saver release/resume of the embedded engine on CUDA (skipped without CUDA).

Device truth is ``torch.cuda.mem_get_info``: torch_memory_saver unmaps physical memory below
the torch allocator, whose own counters do not move.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mllm_rl.checkpoint import ModelDir
from mllm_rl.engine import EngineStateError, SamplingParams, WeightExport
from mllm_rl.engine_state import ManagedEngine
from tests.torch.conftest import needs_cuda

pytestmark = pytest.mark.slow  # every test here starts an engine (or waits on one that did)

PROMPTS = [[51, 71, 68, 220, 66, 64, 79], [160, 121, 254, 162]]
GREEDY = SamplingParams(max_new_tokens=8)


@pytest.fixture
def make(tiny_ckpt):
    needs_cuda()
    pytest.importorskip(
        "torch_memory_saver", reason="needs torch_memory_saver (pip install torch-memory-saver==0.0.10)"
    )
    from mllm_rl.backends.torch.engine import EmbeddedEngine

    model = ModelDir.open(tiny_ckpt)
    made = []

    def make_engine(backup: bool) -> tuple[ManagedEngine, ModelDir]:
        eng = ManagedEngine(EmbeddedEngine(model, weights_cpu_backup=backup, device="cuda"))
        assert eng.engine.memory.mode == "torch_memory_saver"
        eng.update_weights(WeightExport(list(model.tensors), model.iter_tensors(), full=True))
        made.append(eng)
        return eng, model

    yield make_engine
    for eng in made:
        eng.shutdown()


def free_bytes() -> int:
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def test_release_returns_device_memory(make):
    eng, _ = make(False)
    eng.drain()
    for tag in ("kv_cache", "weights"):
        free0 = free_bytes()
        held = eng.release([tag])[tag]
        assert held > 0 and free_bytes() - free0 >= 0.99 * held, tag
    free0 = free_bytes()
    eng.resume(["kv_cache", "weights"])
    assert free0 - free_bytes() >= 0.99 * (eng.tag_bytes("kv_cache") + eng.tag_bytes("weights"))


def test_the_probe_reports_paused_bytes_and_the_audit_takes_allocated_minus_paused(make):
    """torch's allocator still counts a paused region's tensors; the probe names them and the plan's
    audit subtracts them (its figure drops by what the release held, as the driver's does)."""
    from mllm_rl.backends.torch.probe import CudaMemoryProbe
    from mllm_rl.memplan.audit import _device_bytes

    eng, _ = make(False)
    probe = CudaMemoryProbe()

    def record() -> dict:
        devs = [
            dict(id=d.id, source=d.source, bytes_in_use=d.bytes_in_use, raw=d.raw) for d in probe.snapshot()
        ]
        return {"memory": {"devices": devs}}

    before = record()
    eng.drain()
    held = eng.release(["kv_cache", "weights"])
    after = record()
    alloc = next(d for d in after["memory"]["devices"] if d["source"] == "torch_allocator")
    assert alloc["raw"]["paused_bytes"] == held["kv_cache"] + held["weights"]
    assert _device_bytes(before) - _device_bytes(after) >= 0.99 * alloc["raw"]["paused_bytes"]
    eng.resume(["kv_cache", "weights"])
    alloc = next(d for d in record()["memory"]["devices"] if d["source"] == "torch_allocator")
    assert alloc["raw"]["paused_bytes"] == 0


def test_backup_resume_is_bit_identical(make):
    eng, _ = make(True)
    fp0, out0 = eng.weights_fingerprint(), eng.generate(PROMPTS, GREEDY)
    addr0 = {n: p.data_ptr() for n, p in eng.engine.params.items()}
    eng.drain()
    eng.release(["weights", "kv_cache"])
    eng.resume(["weights", "kv_cache"])
    eng.continue_generation()
    assert eng.state()["weights_valid"] is True
    assert eng.weights_fingerprint() == fp0
    assert {n: p.data_ptr() for n, p in eng.engine.params.items()} == addr0  # virtual addresses kept
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == [o.token_ids for o in out0]


def test_no_backup_refuses_until_a_full_update(make):
    eng, model = make(False)
    ref = [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]
    eng.drain()
    eng.release(["weights"])
    eng.resume(["weights"])
    eng.continue_generation()
    with pytest.raises(EngineStateError, match="weights are invalid"):
        eng.generate(PROMPTS, GREEDY)
    with pytest.raises(EngineStateError, match="partial update on invalid weights"):
        eng.update_weights(WeightExport.of(list(model.iter_tensors())[:1], full=False))
    eng.update_weights(WeightExport(list(model.tensors), model.iter_tensors(), full=True))
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == ref


def test_double_pause_is_a_warned_noop_not_an_exit(make):
    eng, _ = make(False)
    eng.drain()
    eng.engine.release_memory("kv_cache")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng.engine.release_memory("kv_cache")  # torch_memory_saver itself would exit(1) here
        eng.engine.resume_memory("kv_cache")
        eng.engine.resume_memory("kv_cache")
    assert sum("already released" in str(x.message) for x in w) == 1
    assert sum("not released" in str(x.message) for x in w) == 1


def test_two_engines_release_independently(make):
    a, _ = make(False)
    b, _ = make(False)
    ref = [o.token_ids for o in b.generate(PROMPTS, GREEDY)]
    a.drain()
    a.release(["weights", "kv_cache"])  # must not touch b's memory
    assert [o.token_ids for o in b.generate(PROMPTS, GREEDY)] == ref

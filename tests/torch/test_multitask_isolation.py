"""Two tasks' embedded torch engines in one process: a release names exactly one task's bytes, and
a weight update sent to one task never changes the other's weights. Device truth on CPU is the
``live_tensors`` probe (distinct storages of every engine's tensors); on CUDA, torch_memory_saver's
process-global tags are the ones named per task (``<task>/weights``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mllm_rl.backends.torch import TorchBackend
from mllm_rl.checkpoint import ModelDir
from mllm_rl.engine import EngineOptions, SamplingParams, WeightExport
from mllm_rl.engine_state import ManagedEngine
from tests.torch.conftest import needs_cuda

PROMPTS = [[51, 71, 68, 220, 66], [160, 121, 254, 162]]
GREEDY = SamplingParams(max_new_tokens=6)


def _total(probe) -> int:
    return sum(u for u in probe.in_use() if u is not None)


def _engines(tiny_ckpt, device: str):
    backend = TorchBackend()
    backend.init_runtime(platform=device)
    model = ModelDir.open(tiny_ckpt)
    kw = {"context_length": 64, "max_total_tokens": 256, "max_running_requests": 4, "engine": "embedded"}
    a = ManagedEngine(backend.create_engine(model, EngineOptions(task="a", **kw)))
    b = ManagedEngine(backend.create_engine(model, EngineOptions(task="b", **kw)))
    for e in (a, b):  # real weights in both, so generation means something
        e.update_weights(WeightExport(list(model.tensors), model.iter_tensors(), full=True))
    return backend, model, a, b


@pytest.fixture()
def two_engines(tiny_ckpt):
    backend, model, a, b = _engines(tiny_ckpt, "cpu")
    yield backend, model, a, b
    a.shutdown()
    b.shutdown()


def test_releasing_task_a_frees_exactly_its_bytes_and_leaves_b_untouched(two_engines):
    backend, _, a, b = two_engines
    probe = backend.memory_probe()
    fp_b, out_b = b.weights_fingerprint(), [o.token_ids for o in b.generate(PROMPTS, GREEDY)]
    before = _total(probe)
    a.drain()
    held = a.release(["weights", "kv_cache"])
    assert [a.engine.memory_tag(t) for t in held] == ["a/weights", "a/kv_cache"]
    assert before - _total(probe) == sum(held.values()) > 0  # device truth: exactly a's bytes went
    assert {t: b.tag_bytes(t) for t in ("weights", "kv_cache")} == {
        t: a.engine.tag_bytes(t) for t in ("weights", "kv_cache")
    }  # b still holds the same as a held (same model)
    assert b.weights_fingerprint() == fp_b
    assert [o.token_ids for o in b.generate(PROMPTS, GREEDY)] == out_b
    back = a.resume(["weights", "kv_cache"])
    assert _total(probe) == before and back == held


def test_a_weight_update_to_task_a_never_changes_task_b(two_engines):
    _, model, a, b = two_engines
    fp_b = b.weights_fingerprint()
    rng = np.random.default_rng(0)
    new = [(n, rng.standard_normal(model.tensors[n][1].shape).astype(np.float32)) for n in model.tensors]
    a.update_weights(WeightExport.of(new, full=True))
    fp_a = a.weights_fingerprint()
    assert b.weights_fingerprint() == fp_b
    assert all(abs(fp_a[n][1] - float((x.astype(np.float64) ** 2).sum())) < 1e-3 * fp_a[n][1] for n, x in new)
    assert fp_a != fp_b


def test_storage_release_names_its_task_in_warnings(two_engines):
    _, _, a, _ = two_engines
    a.drain()
    a.release(["kv_cache"])
    with pytest.warns(UserWarning, match=r"release\('a/kv_cache'\): already released"):
        a.engine.memory.release("kv_cache", [], cpu_backup=False)


def test_cuda_torch_memory_saver_tags_are_per_task(tiny_ckpt):
    needs_cuda()
    pytest.importorskip("torch_memory_saver", reason="needs torch_memory_saver on CUDA")
    from mllm_rl.backends.torch.memory import SaverMemory

    backend, _, a, b = _engines(tiny_ckpt, "cuda")
    probe = backend.memory_probe()
    assert isinstance(a.engine.memory, SaverMemory) and a.engine.memory.name("weights") == "a/weights"
    with pytest.raises(ValueError, match="a/"):
        SaverMemory(torch.device("cuda"), "a")
    fp_b = b.weights_fingerprint()
    torch.cuda.synchronize()
    truth0 = probe.snapshot()[0].bytes_in_use  # mem_get_info: below the allocator
    a.drain()
    held = a.release(["weights", "kv_cache"])
    truth1 = probe.snapshot()[0].bytes_in_use
    assert truth0 - truth1 >= 0.9 * sum(held.values())
    assert b.weights_fingerprint() == fp_b

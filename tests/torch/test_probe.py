"""Torch memory probes: CPU live-tensor bytes (exact, deduplicated, rate-limited in the sampler)."""

from __future__ import annotations

import threading
import time

import torch

from mllm_rl.backends.torch.probe import SAMPLER_THREAD, CpuTensorProbe, live_cpu_tensor_bytes
from mllm_rl.phases.recorder import PhaseRecorder
from mllm_rl.phases.schema import validate_record
from tests.torch.conftest import needs_cuda

MB = 2**20


def test_cpu_probe_counts_distinct_storages_once():
    probe = CpuTensorProbe()
    base = probe.in_use()[0]
    x = torch.empty(4 * MB, dtype=torch.uint8)
    views = [x[: MB], x.view(torch.float32), x[1:]]  # same storage, counted once
    assert probe.in_use()[0] - base == 4 * MB
    x.untyped_storage().resize_(0)  # what release(weights) does on CPU
    assert probe.in_use()[0] - base == 0
    del x, views
    p = torch.nn.Parameter(torch.zeros(MB // 4))
    assert probe.in_use()[0] - base == MB
    del p
    assert probe.in_use()[0] == base


def test_cpu_probe_snapshot_is_schema_shaped():
    (d,) = CpuTensorProbe().snapshot()
    assert (d.id, d.platform, d.source, d.peak_bytes_in_use, d.bytes_limit) == (0, "cpu", "live_tensors", None, None)
    assert d.bytes_in_use == d.raw["live_tensors_bytes"] and d.raw["scan_ms"] > 0


def test_sampler_thread_is_rate_limited_but_explicit_samples_are_exact():
    probe = CpuTensorProbe(min_interval_s=60.0)
    seen: list[int | None] = []
    th = threading.Thread(target=lambda: seen.extend(probe.in_use() + probe.in_use()), name=SAMPLER_THREAD)
    th.start()
    th.join()
    x = torch.empty(2 * MB, dtype=torch.uint8)
    late: list[int | None] = []
    th = threading.Thread(target=lambda: late.extend(probe.in_use()), name=SAMPLER_THREAD)
    th.start()
    th.join()
    assert late == [seen[0]]  # cached: the sampler may not rescan within the interval
    assert probe.in_use()[0] == seen[0] + 2 * MB  # the main thread always rescans
    del x


def test_recorder_phase_peak_sees_a_temporary_at_an_explicit_sample():
    rec = PhaseRecorder("t", "torch", probe=CpuTensorProbe())
    with rec.phase("p"):
        tmp = torch.empty(8 * MB, dtype=torch.uint8)
        rec.sample()
        del tmp
    r = rec.records[0]
    validate_record({**r, "info": {}})
    d = r["memory"]["devices"][0]
    assert d["phase_peak_bytes"] >= d["bytes_in_use"] + 8 * MB
    rec.close()


def test_scan_cost_is_bounded():
    t0 = time.perf_counter()
    live_cpu_tensor_bytes()
    assert time.perf_counter() - t0 < 2.0  # ~50 ms at ~230k objects; a regression guard, not a benchmark


def test_cuda_probe_has_driver_truth_and_allocator_entries_per_device():
    needs_cuda()
    from mllm_rl.backends.torch.probe import CudaMemoryProbe

    probe = CudaMemoryProbe()
    snap = probe.snapshot()
    assert [(d.id, d.source) for d in snap[:2]] == [(0, "mem_get_info"), (0, "torch_allocator")]
    assert len(probe.in_use()) == len(snap)
    before = probe.in_use()
    x = torch.empty(256 * MB, dtype=torch.uint8, device="cuda")
    after = probe.in_use()
    assert after[0] - before[0] >= 256 * MB and after[1] - before[1] >= 256 * MB
    del x
    probe.reset_peak()
    assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0)


def test_sources_are_known_to_the_schema():
    from mllm_rl.phases.schema import SOURCES

    assert {"live_tensors", "mem_get_info", "torch_allocator"} <= set(SOURCES)

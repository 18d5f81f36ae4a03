"""Torch memory probes: CPU bytes of the tensors the engine and trainer hold (registered holders)."""

from __future__ import annotations

import threading

import torch

from mllm_rl.backends.torch.probe import CpuTensorProbe, track, tracked_cpu_bytes
from mllm_rl.phases.recorder import PhaseRecorder
from mllm_rl.phases.schema import validate_record
from tests.torch.conftest import needs_cuda

MB = 2**20


class Holder:
    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors = list(tensors)
        track(self)

    def held_tensors(self) -> list[torch.Tensor]:
        return self.tensors


def test_cpu_probe_counts_distinct_storages_of_holders_once():
    probe = CpuTensorProbe()
    base = probe.in_use()[0]
    x = torch.empty(4 * MB, dtype=torch.uint8)
    h = Holder(x, x[:MB], x.view(torch.float32), x[1:])  # one storage, counted once
    assert probe.in_use()[0] - base == 4 * MB
    untracked = torch.empty(8 * MB, dtype=torch.uint8)  # a temporary: host RSS shows it, not this probe
    assert probe.in_use()[0] - base == 4 * MB
    x.untyped_storage().resize_(0)  # what release(weights) / offload do on CPU
    assert probe.in_use()[0] - base == 0
    h.tensors.append(torch.nn.Parameter(torch.zeros(MB // 4)))
    assert probe.in_use()[0] - base == MB
    del h, untracked
    assert probe.in_use()[0] == base  # holders are weakly referenced


def test_cpu_probe_snapshot_is_schema_shaped():
    h = Holder(torch.zeros(MB // 4))
    (d,) = CpuTensorProbe().snapshot()
    assert (d.id, d.platform, d.source, d.peak_bytes_in_use, d.bytes_limit) == (
        0,
        "cpu",
        "live_tensors",
        None,
        None,
    )
    assert d.bytes_in_use == d.raw["live_tensors_bytes"] == tracked_cpu_bytes()[0] >= MB
    del h


def test_sampling_from_another_thread_does_not_disturb_tuple_building():
    """The old gc.get_objects() scan made a concurrent tuple(generator) raise SystemError."""
    h = Holder(torch.zeros(1024))
    probe, stop, errors = CpuTensorProbe(), threading.Event(), []

    def sample() -> None:
        while not stop.is_set():
            probe.in_use()

    th = threading.Thread(target=sample)
    th.start()
    try:
        for _ in range(20000):
            tuple(x for x in range(50))
    except SystemError as e:  # pragma: no cover - the failure this guards against
        errors.append(e)
    finally:
        stop.set()
        th.join()
    assert errors == []
    del h


def test_recorder_phase_peak_sees_a_held_tensor_at_an_explicit_sample():
    h = Holder()
    rec = PhaseRecorder("t", "torch", probe=CpuTensorProbe())
    with rec.phase("p"):
        h.tensors.append(torch.empty(8 * MB, dtype=torch.uint8))
        rec.sample()
        h.tensors.clear()
    r = rec.records[0]
    validate_record({**r, "info": {}})
    d = r["memory"]["devices"][0]
    assert d["phase_peak_bytes"] >= d["bytes_in_use"] + 8 * MB
    rec.close()


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


def test_largest_blocks_reads_allocated_blocks_of_one_device_from_a_snapshot():
    """``largest_blocks`` on a FAKE of ``torch.cuda.memory_snapshot()``'s shape (segments of a
    device, each with blocks and their state): only ``active_allocated`` blocks of that device,
    largest first, at most ``n``."""
    from mllm_rl.backends.torch.probe import largest_blocks

    mib = 2**20
    segments = [
        {"device": 0, "blocks": [{"size": 32 * mib, "state": "active_allocated"},
                                 {"size": 90 * mib, "state": "inactive"}]},
        {"device": 1, "blocks": [{"size": 500 * mib, "state": "active_allocated"}]},
        {"device": 0, "blocks": [{"size": 2 * mib, "state": "active_allocated"},
                                 {"size": 32 * mib, "state": "active_allocated"},
                                 {"size": 64 * mib, "state": "active_pending_free"}]},
    ]  # fmt: skip
    assert largest_blocks(segments, 0) == [32 * mib, 32 * mib, 2 * mib]
    assert largest_blocks(segments, 0, n=1) == [32 * mib]
    assert largest_blocks(segments, 1) == [500 * mib] and largest_blocks(segments, 2) == []


def test_cuda_probe_names_a_held_block_by_its_size():
    needs_cuda()
    from mllm_rl.backends.torch.probe import CudaMemoryProbe

    x = torch.empty(96 * MB, dtype=torch.uint8, device="cuda")
    blocks = CudaMemoryProbe().snapshot()[1].raw["largest_blocks"]
    assert x.untyped_storage().nbytes() in blocks, blocks


def test_sources_are_known_to_the_schema():
    from mllm_rl.phases.schema import SOURCES

    assert {"live_tensors", "mem_get_info", "torch_allocator"} <= set(SOURCES)

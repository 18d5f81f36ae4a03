"""What the CUDA probe subtracts from torch's allocator: the bytes of torch_memory_saver regions an
engine has paused (``SaverMemory.paused_bytes``, ``probe.paused_cuda_bytes``). torch_memory_saver
needs CUDA, so ``FakeSaver`` stands in for it here (a fake of the package's pause/resume/region
calls, recording them); ``tests/torch/test_cuda_memory.py`` checks the same on a GPU."""

from __future__ import annotations

import contextlib
import sys
import types

import torch

from mllm_rl.backends.torch import memory, probe


class FakeSaver:
    """Fake torch_memory_saver: records pause/resume by tag."""

    _impl = object()  # "already configured": SaverMemory leaves hook_mode alone

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def pause(self, tag: str) -> None:
        self.calls.append(("pause", tag))

    def resume(self, tag: str) -> None:
        self.calls.append(("resume", tag))

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False):
        yield


def test_paused_bytes_count_each_storage_once_and_drop_on_resume(monkeypatch):
    fake = FakeSaver()
    monkeypatch.setitem(sys.modules, "torch_memory_saver", types.SimpleNamespace(torch_memory_saver=fake))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    mem = memory.SaverMemory(torch.device("cuda", 0))
    w = torch.zeros(1000)  # 4000 B
    kv = torch.zeros(250)  # 1000 B
    mem.release("weights", [w, w[:10], w.view(10, 100)], cpu_backup=False)  # one storage, three views
    assert mem.paused_bytes() == 4000
    mem.release("kv_cache", [kv], cpu_backup=False)
    assert mem.paused_bytes() == 5000
    mem.resume("weights", [w])
    assert mem.paused_bytes() == 1000
    assert [c for c, _ in fake.calls] == ["pause", "pause", "resume"]


def test_the_probe_sums_the_holders_paused_bytes_per_device():
    class Holder:
        def __init__(self, device: int, n: int | None) -> None:
            self.got = None if n is None else (device, n)

        def paused_device_bytes(self):
            return self.got

        def held_tensors(self):
            return []

    holders = [Holder(0, 100), Holder(0, 20), Holder(1, 7), Holder(0, None)]
    for h in holders:
        probe.track(h)
    assert probe.paused_cuda_bytes(0) == 120
    assert probe.paused_cuda_bytes(1) == 7
    assert probe.paused_cuda_bytes(2) is None  # nothing pauses there: the driver's figure stands

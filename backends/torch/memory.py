"""Release/resume of the embedded engine's device memory by tag; the tensor objects stay.

``SaverMemory`` (CUDA with torch_memory_saver) unmaps a region and maps new memory at the same
addresses; torch_memory_saver ``exit(1)``s on a repeated pause or resume and its tags are
process-global, so each engine gets its own tags and repeats are warned no-ops. ``StorageMemory``
(otherwise) resizes storages to 0 (backed up to host first) and back.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings
from collections.abc import Iterator

import numpy as np
import torch

from mllm_rl.backends.torch.offload import from_host_bytes, to_host_bytes


def saver_available(device: torch.device) -> bool:
    """torch_memory_saver can manage ``device`` (a CUDA device and the package importable)."""
    if device.type != "cuda":
        return False
    try:
        import torch_memory_saver  # noqa: F401
    except ImportError:
        return False
    return True


class StorageMemory:
    """Release by resizing tensor storages to 0 (see module docstring)."""

    mode = "storage_resize"

    def __init__(self, device: torch.device, task: str | None = None) -> None:
        self.device = device
        self.prefix = f"{task}/" if task else ""
        self._backup: dict[str, list[np.ndarray]] = {}
        self._released: set[str] = set()

    def name(self, tag: str) -> str:
        """The tag's name in records, warnings and torch_memory_saver (``<task>/<tag>`` for a task's engine)."""
        return self.prefix + tag

    def region(self, tag: str, cpu_backup: bool = False) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def release(self, tag: str, tensors: list[torch.Tensor], cpu_backup: bool) -> None:
        if tag in self._released:
            warnings.warn(f"release({self.name(tag)!r}): already released; no-op", stacklevel=2)
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if cpu_backup:
            self._backup[tag] = [to_host_bytes(t) for t in tensors]
        for t in tensors:
            t.untyped_storage().resize_(0)
        self._released.add(tag)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume(self, tag: str, tensors: list[torch.Tensor]) -> bool:
        if tag not in self._released:
            warnings.warn(f"resume({self.name(tag)!r}): not released; no-op", stacklevel=2)
            return True
        backup = self._backup.pop(tag, None)
        for t in tensors:
            t.untyped_storage().resize_(t.numel() * t.element_size())
            if backup is not None:
                from_host_bytes(t, backup.pop(0))  # host copies are freed as they are restored
            else:
                t.zero_()
        self._released.discard(tag)
        return backup is not None


_ENGINE_IDS = itertools.count()  # region tag prefixes, unique in the process
_TASK_PREFIXES: set[str] = set()  # "<task>/" prefixes in use by a SaverMemory of this process


class SaverMemory(StorageMemory):
    """torch_memory_saver regions, tagged per instance (see the module docstring); ``name`` is the
    torch_memory_saver tag."""

    mode = "torch_memory_saver"

    def __init__(self, device: torch.device, task: str | None = None) -> None:
        from torch_memory_saver import torch_memory_saver

        if task and f"{task}/" in _TASK_PREFIXES:  # two engines pausing each other's bytes
            raise ValueError(
                f"torch_memory_saver tags {task}/*: already used by another engine of this process"
            )
        if getattr(torch_memory_saver, "_impl", None) is None:  # configurable until first use
            torch_memory_saver.hook_mode = "torch"
        self.tms = torch_memory_saver
        self.device = device
        self.prefix = f"{task}/" if task else f"mllm_rl-{next(_ENGINE_IDS)}-"
        if task:
            _TASK_PREFIXES.add(self.prefix)
        self._backup: dict[str, bool] = {}
        self._paused: dict[str, int] = {}  # our tags paused now -> their tensors' bytes

    def paused_bytes(self) -> int:
        """Bytes of this engine's paused tensors (still counted by torch's allocator)."""
        return sum(self._paused.values())

    @contextlib.contextmanager
    def region(self, tag: str, cpu_backup: bool = False) -> Iterator[None]:
        self._backup[tag] = cpu_backup
        with (
            torch.cuda.device(self.device),
            self.tms.region(tag=self.prefix + tag, enable_cpu_backup=cpu_backup),
        ):
            yield

    def release(self, tag: str, tensors: list[torch.Tensor], cpu_backup: bool) -> None:
        if tag in self._paused:  # a second tms.pause would exit(1) the process
            warnings.warn(f"release({tag!r}): already released; no-op", stacklevel=2)
            return
        torch.cuda.synchronize(self.device)  # no kernel may still use the memory being unmapped
        self.tms.pause(self.prefix + tag)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        self._paused[tag] = sum(storages.values())

    def resume(self, tag: str, tensors: list[torch.Tensor]) -> bool:
        if tag not in self._paused:  # tms.resume of an active allocation would exit(1)
            warnings.warn(f"resume({tag!r}): not released; no-op", stacklevel=2)
            return True
        self.tms.resume(self.prefix + tag)
        del self._paused[tag]
        torch.cuda.synchronize(self.device)
        return self._backup.get(tag, False)


def make_memory(device: torch.device, task: str | None = None) -> StorageMemory | SaverMemory:
    """``task``: the tags' namespace (``<task>/weights``) for a task's engine of a multi-task run."""
    return SaverMemory(device, task) if saver_available(device) else StorageMemory(device, task)

"""Offload/onload of a group of tensors (the trainer's params or optimizer state): each distinct
storage is copied to the host (CUDA: pinned; CPU: numpy, not counted as device memory) and resized
to 0, and back; the tensor objects stay. CPU tensors of a CUDA group (AdamW counters) stay put.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch


def _storages(tensors: Iterable[torch.Tensor], device: torch.device) -> dict[int, torch.UntypedStorage]:
    """The distinct non-empty storages of ``tensors`` on ``device``'s type now, by address."""
    out: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        if t.device.type == device.type and (st := t.untyped_storage()).nbytes():
            out.setdefault(st.data_ptr(), st)
    return out


def storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages of ``tensors`` that live on ``device``'s type now."""
    return sum(st.nbytes() for st in _storages(tensors, device).values())


def host_copy(t: torch.Tensor, device: torch.device) -> Any:
    """A host copy of ``t``'s bytes: pinned (CUDA; ``synchronize`` before reading) or numpy uint8."""
    if device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t.detach(), non_blocking=True)
        return host
    return to_host_bytes(t)


def to_host_bytes(t: torch.Tensor) -> np.ndarray:
    """A numpy uint8 copy [nbytes] of ``t``'s bytes (any device; a blocking copy)."""
    host = np.empty(t.numel() * t.element_size(), np.uint8)
    torch.from_numpy(host).copy_(t.detach().reshape(-1).view(torch.uint8))
    return host


def from_host_bytes(t: torch.Tensor, host: np.ndarray) -> None:
    """Copy ``to_host_bytes``' buffer back into ``t`` (same nbytes; a blocking copy)."""
    t.detach().reshape(-1).view(torch.uint8).copy_(torch.from_numpy(host))


def device_tensor(host: Any, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A tensor like ``like`` (typed ``dtype``) holding ``host``'s bytes (on CPU a view)."""
    if isinstance(host, torch.Tensor):
        return host.to(like.device, non_blocking=True)
    return torch.from_numpy(host).view(dtype or like.dtype).view(like.shape)


def _restore(t: torch.Tensor, host: Any) -> None:
    if isinstance(host, torch.Tensor):  # pinned (CUDA)
        t.detach().copy_(host, non_blocking=True)
    else:  # numpy bytes: only CPU tensors are held as numpy (see ``host_copy``)
        from_host_bytes(t, host)


def storage_bytes_view(st: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor [nbytes] over the whole storage ``st`` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


class OffloadGroup:
    """One group of tensors (``params`` or ``optimizer``) that is resident or on the host."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        # (storage, nbytes, host copy) while offloaded
        self._held: list[tuple[torch.UntypedStorage, int, Any]] | None = None

    @property
    def resident(self) -> bool:
        return self._held is None

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move the tensors' distinct storages to the host, freed on the device; the bytes freed."""
        if self._held is not None:
            return 0
        with torch.no_grad():
            held = [
                (st, st.nbytes(), host_copy(storage_bytes_view(st), self.device))
                for st in _storages(tensors, self.device).values()
            ]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for st, _, _ in held:
                st.resize_(0)
        self._held = held
        return sum(n for _, n, _ in held)

    def onload(self) -> None:
        """Re-allocate the device storages and copy the host bytes back (no-op when resident)."""
        if self._held is None:
            return
        with torch.no_grad():
            for st, nbytes, host in self._held:
                st.resize_(nbytes)
                _restore(storage_bytes_view(st), host)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self._held = None

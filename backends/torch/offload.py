"""Offload/onload of a group of torch tensors that keeps the tensor objects (the trainer's
params, the optimizer's state): ``Parameter`` identities, shapes, dtypes and devices stay,
so the model and ``torch.optim`` keep using the same objects; only the bytes move.

- ``offload``: copy each tensor to host memory (CUDA: pinned CPU tensors through torch's
  caching host allocator, copied with ``non_blocking`` and one synchronize; CPU: numpy
  buffers, which the ``live_tensors`` probe does not count as device memory), then resize
  its storage to 0 bytes: the device memory is given back (CUDA: to the caching allocator,
  ``empty_cache`` returns it to the driver; CPU: freed).
- ``onload``: resize each storage back and copy the host bytes in; the host copies go.

Round trips are bit-exact (raw bytes are copied). Tensors must own their whole storage
(no views, no shared storages); CPU tensors of a CUDA group (torch's AdamW ``step``
scalars) are host memory already and stay where they are. A fused AdamW's (``adamw=fused``)
``step`` scalars live on the device: 0-dim tensors owning their 4-byte storages, moved like the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch


def storage_bytes(tensors: Iterable[torch.Tensor], device: torch.device) -> int:
    """Bytes of the distinct storages of ``tensors`` that live on ``device``'s type now."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type == device.type:
            st = t.untyped_storage()
            if st.nbytes():
                seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def host_copy(t: torch.Tensor, device: torch.device) -> Any:
    """A host copy of ``t``'s bytes: a pinned CPU tensor (CUDA; call ``synchronize`` before
    reading it) or a numpy uint8 buffer [nbytes] (CPU)."""
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
    """A tensor shaped like ``like`` on its device, typed ``dtype`` (by default ``like``'s: the
    dtype ``host``'s bytes were copied from), holding ``host``'s bytes (a new tensor; on CPU a
    view of the numpy buffer, no copy)."""
    if isinstance(host, torch.Tensor):
        return host.to(like.device, non_blocking=True)
    return torch.from_numpy(host).view(dtype or like.dtype).view(like.shape)


def _restore(t: torch.Tensor, host: Any) -> None:
    if isinstance(host, torch.Tensor):  # pinned (CUDA)
        t.detach().copy_(host, non_blocking=True)
    else:  # numpy bytes: only CPU tensors are held as numpy (see ``host_copy``)
        from_host_bytes(t, host)


class OffloadGroup:
    """One group of tensors (``params`` or ``optimizer``) that is resident or on the host."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name = name
        self.device = device
        self._held: list[tuple[torch.Tensor, Any]] | None = None  # (tensor, host copy) while offloaded

    @property
    def resident(self) -> bool:
        return self._held is None

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Move ``tensors``' bytes to the host and free their device storage; returns the
        device bytes freed (0 when the group is offloaded already)."""
        if self._held is not None:
            return 0
        mine = [t for t in tensors if t.device.type == self.device.type]
        for t in mine:
            st = t.untyped_storage()
            if t.storage_offset() or st.nbytes() != t.numel() * t.element_size() or not t.is_contiguous():
                raise ValueError(
                    f"offload({self.name}): a tensor {tuple(t.shape)} does not own its whole storage"
                )
        if len({t.untyped_storage().data_ptr() for t in mine}) != len(mine):
            raise ValueError(f"offload({self.name}): tensors share a storage")
        freed = storage_bytes(mine, self.device)
        with torch.no_grad():
            held = [(t, host_copy(t, self.device)) for t in mine]
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            for t in mine:
                t.untyped_storage().resize_(0)
        self._held = held
        return freed

    def onload(self) -> None:
        """Re-allocate the device storages and copy the host bytes back (no-op when resident)."""
        if self._held is None:
            return
        with torch.no_grad():
            for t, host in self._held:
                t.untyped_storage().resize_(t.numel() * t.element_size())
                _restore(t, host)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        self._held = None

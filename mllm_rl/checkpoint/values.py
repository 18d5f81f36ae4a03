"""Refuse checkpoints holding NaN or infinite weights, streaming tensor by tensor.

A non-finite weight makes every forward NaN; training on it "works" (the loss is NaN, the
weights stay NaN) and the engine fingerprint cannot object. The scan reads each tensor
through its memmap in fixed-size chunks (no whole-tensor copy, host memory bounded by one
chunk) and tests the exponent bits directly: a float is non-finite exactly when all of its
exponent bits are set, for F32, BF16 and F16 alike, so no dtype conversion is needed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from mllm_rl.checkpoint.safetensors_io import TensorInfo, read_tensor

# safetensors dtype -> (same-width unsigned view, exponent mask)
_EXPONENT = {
    "F32": (np.dtype(np.uint32), 0x7F800000),
    "BF16": (np.dtype(np.uint16), 0x7F80),
    "F16": (np.dtype(np.uint16), 0x7C00),
}
CHUNK_ELEMS = 8 * 2**20  # 16-32 MiB of a tensor per step


class NonFiniteError(ValueError):
    """A tensor holds NaN/inf; the message names file, tensor, count and the first index."""


def count_nonfinite(arr: np.ndarray, dtype: str, chunk_elems: int = CHUNK_ELEMS) -> tuple[int, int]:
    """(number of non-finite values, flat index of the first or -1) of ``arr`` (any shape,
    stored as safetensors ``dtype``), read ``chunk_elems`` elements at a time."""
    view_dtype, mask = _EXPONENT[dtype]
    flat = arr.reshape(-1).view(view_dtype)
    mask = view_dtype.type(mask)
    count, first = 0, -1
    buf = np.empty(min(chunk_elems, flat.size), view_dtype)
    hit = np.empty(buf.size, bool)
    for start in range(0, flat.size, chunk_elems):
        part = flat[start : start + chunk_elems]
        b, h = buf[: part.size], hit[: part.size]
        np.bitwise_and(part, mask, out=b)
        np.equal(b, mask, out=h)
        if h.any():
            n = int(np.count_nonzero(h))
            if first < 0:
                first = start + int(np.argmax(h))
            count += n
    return count, first


def check_finite(
    tensors: Iterable[tuple[str, Path, TensorInfo]], on_bytes: Callable[[int], None] | None = None
) -> None:
    """Raise ``NonFiniteError`` at the first tensor holding a NaN or an infinity."""
    for name, file, info in tensors:
        if info.dtype not in _EXPONENT:
            continue  # not a float: nothing to check (dtypes are validated elsewhere)
        count, first = count_nonfinite(read_tensor(file, info), info.dtype)
        if count:
            index = list(np.unravel_index(first, info.shape)) if info.shape else []
            raise NonFiniteError(
                f"{file}: tensor {name}: {count} non-finite value(s) (NaN/inf), "
                f"first at index {[int(i) for i in index]}"
            )
        if on_bytes is not None:
            on_bytes(info.nbytes)

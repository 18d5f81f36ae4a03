"""Streaming safetensors I/O with numpy only (bf16 via ``ml_dtypes``): an 8-byte header length, a
JSON header ``{name: {"dtype", "shape", "data_offsets"}}``, the raw bytes. Written a tensor at a
time, read as views of read-only memory maps (one per file and pass); ``check_finite`` refuses
NaN/inf weights, streaming."""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
}
_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
    """A malformed safetensors file; the message names the file (and tensor)."""


def dtype_name(dtype: np.dtype) -> str:
    try:
        return _NAMES[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors name") from None


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def write_file(
    path: Path,
    tensors: Iterable[tuple[str, tuple[int, ...], str, Callable[[], np.ndarray]]],
    metadata: dict[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> None:
    """Write ``(name, shape, dtype_name, make)`` entries, calling ``make()`` one at a time so peak
    host memory is one tensor."""
    entries = list(tensors)
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dt, _ in entries:
        n = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dt, make in entries:
            arr = np.ascontiguousarray(make())
            if arr.shape != tuple(shape) or dtype_name(arr.dtype) != dt:
                raise ValueError(f"{name}: produced {arr.shape}/{arr.dtype}, declared {shape}/{dt}")
            f.write(arr.reshape(-1).view(np.uint8).data)
            if on_bytes is not None:
                on_bytes(arr.nbytes)
            del arr
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check a header: every tensor's bytes must lie inside the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{path}: truncated (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise SafetensorsError(f"{path}: header length {n} exceeds file size {size}")
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header is not a JSON object")
    base = 8 + n
    out: dict[str, TensorInfo] = {}
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        try:
            dt, shape, (b, e) = spec["dtype"], tuple(int(s) for s in spec["shape"]), spec["data_offsets"]
            b, e = int(b), int(e)
            if not isinstance(dt, str) or b < 0 or e < b or any(s < 0 for s in shape):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{path}: tensor {name}: malformed header entry") from None
        if dt not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name}: unsupported dtype {dt}")
        want = int(np.prod(shape, dtype=np.int64)) * DTYPES[dt].itemsize
        if e - b != want:
            raise SafetensorsError(f"{path}: tensor {name}: {e - b} bytes for shape {list(shape)} {dt}")
        if base + e > size:
            raise SafetensorsError(
                f"{path}: tensor {name}: truncated (needs {base + e} bytes, file has {size})"
            )
        out[name] = TensorInfo(name, dt, shape, base + b, base + e)
    return out


def read_tensor(path: Path, info: TensorInfo, maps: dict[Path, mmap.mmap] | None = None) -> np.ndarray:
    """A read-only view of one tensor (shape ``info.shape``, dtype ``info.dtype``) in a memory map
    of its file, no copy. ``maps``: the maps of one pass over many tensors, one per file (a map
    costs system calls and page faults; a swap reads hundreds of tensors twice); the pass drops
    the dict and each map closes with its last view, so no file stays mapped after the pass."""
    if info.nbytes == 0:
        return np.zeros(info.shape, DTYPES[info.dtype])
    mapped = maps.get(path) if maps is not None else None
    if mapped is None:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        if maps is not None:
            maps[path] = mapped
    count = info.nbytes // DTYPES[info.dtype].itemsize
    return np.frombuffer(mapped, DTYPES[info.dtype], count, info.begin).reshape(info.shape)


# safetensors dtype -> (same-width unsigned view, exponent mask)
_EXPONENT = {
    "F32": (np.dtype(np.uint32), 0x7F800000),
    "BF16": (np.dtype(np.uint16), 0x7F80),
    "F16": (np.dtype(np.uint16), 0x7C00),
}
CHUNK_ELEMS = 8 * 2**20  # 16-32 MiB of a tensor per step


class NonFiniteError(SafetensorsError):
    """A tensor holds NaN/inf (a NaN forward trains "fine"); names file, tensor, count, first index."""


def count_nonfinite(arr: np.ndarray, dtype: str, chunk_elems: int = CHUNK_ELEMS) -> tuple[int, int]:
    """(number of non-finite values, flat index of the first or -1) of ``arr`` (safetensors
    ``dtype``), read in chunks (bounded host memory): non-finite is all exponent bits set."""
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
    maps: dict[Path, mmap.mmap] = {}  # this pass's, one per file
    for name, file, info in tensors:
        if info.dtype not in _EXPONENT:
            continue  # not a float: nothing to check (dtypes are validated elsewhere)
        count, first = count_nonfinite(read_tensor(file, info, maps), info.dtype)
        if count:
            index = list(np.unravel_index(first, info.shape)) if info.shape else []
            raise NonFiniteError(
                f"{file}: tensor {name}: {count} non-finite value(s) (NaN/inf), "
                f"first at index {[int(i) for i in index]}"
            )
        if on_bytes is not None:
            on_bytes(info.nbytes)

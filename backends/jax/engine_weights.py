"""An engine's weight leaves: HF-named tensors placed and written into the arrays its forward reads.

Pure JAX (no sglang-jax import). An engine's weights are a list of leaves and a map HF name ->
``(leaf index, transpose)`` (the leaf holds HF ``[out, in]`` as ``[in, out]``). Accepted values: a
host ndarray or ``jax.Array`` in HF layout; ``KernelInOut(a)``; either as ``Owned`` (kept, not
copied); ``Placed(a)`` (``stream`` only) in the leaf's layout. Transposes and casts run on the
devices (a strided host transpose is slower than a copy), except for a host tensor above the chunk
size on one CPU device (``replace_on_host``: there XLA:CPU's pass over a 16-bit buffer costs more).
``MLLM_RL_HOST_LAYOUT=1`` (a diagnostic, ``scripts/device/jax_fault_probe.sh``): a host tensor is
transposed and cast on the host and sent once, as before transposes moved to the devices.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from mllm_rl.backends.jax.export_layout import KernelInOut, unwrap
from mllm_rl.backends.jax.fingerprint import fingerprint, tensor_sums
from mllm_rl.backends.jax.sharding import on_cpu
from mllm_rl.engine import Fingerprint, Placed
from mllm_rl.faults import fault

Sums = tuple[jax.Array, jax.Array]  # (sum, sum of squares) as float32 device scalars


ALIGN = 64  # bytes: JAX CPU's ``device_put`` aliases a host array so aligned instead of copying
HOST_LAYOUT = "MLLM_RL_HOST_LAYOUT"  # "1": host tensors laid out on the host (module docstring)


def host_copy(arr: np.ndarray, dtype: Any, into: np.ndarray | None = None) -> np.ndarray:
    """A C-contiguous copy of ``arr`` as ``dtype`` in memory of its own, ``ALIGN``-byte aligned
    (in ``into``, an ``aligned_empty`` buffer, when it is large enough).

    On JAX CPU ``jax.device_put`` aliases an aligned host array (a mapped checkpoint's pages
    would change once the mapping is gone: hence the copy) and copies an unaligned one, more
    slowly than a memcpy (numpy aligns to 16 bytes): an aligned copy is the only copy."""
    nbytes = int(np.prod(arr.shape)) * np.dtype(dtype).itemsize
    raw = into if into is not None and into.nbytes >= nbytes else aligned_empty(nbytes)
    out = raw[:nbytes].view(dtype).reshape(arr.shape)
    np.copyto(out, arr, casting="unsafe")
    return out


FRESH_BYTES = 32 * 2**20  # glibc maps blocks this large afresh (its largest mmap threshold)


def aligned_empty(nbytes: int) -> np.ndarray:
    """``nbytes`` of uninitialised host memory (``uint8``), ``ALIGN``-byte aligned. A block of
    ``FRESH_BYTES`` or more is an anonymous map of its own, populated when made (unmapped with the
    last array that views it): numpy would ask for huge pages, whose first touch can wait on memory
    compaction."""
    if nbytes >= FRESH_BYTES:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return np.frombuffer(mmap.mmap(-1, nbytes, flags=flags), np.uint8)
    raw = np.empty(nbytes + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + nbytes]


def dotted(path: tuple[Any, ...]) -> str:
    """A pytree key path as a dotted name (``layers.0.mlp.up_proj.kernel``; a trailing
    ``value`` of an nnx variable dropped), as sglang-jax's mappings spell it."""
    parts = [str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path]
    return ".".join(parts[:-1] if parts and parts[-1] == "value" else parts)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _to_layout(x: jax.Array, transpose: bool, dtype: Any) -> jax.Array:
    """``x.T`` (``transpose``) or ``x``, as ``dtype``: a new array on ``x``'s devices."""
    return (x.T if transpose else x).astype(dtype)


def to_engine(
    x: jax.Array, transpose: bool, dtype: Any, sharding: jax.sharding.Sharding, owned: bool = False
) -> jax.Array:
    """``x.T`` (``transpose``) or ``x`` as ``dtype`` with ``sharding``, in a buffer of its own:
    a transpose or cast runs where ``x`` lives; else ``x`` is copied unless ``owned`` (an aliased
    buffer would be deleted by its owner later)."""
    if transpose or x.dtype != dtype:
        return jax.device_put(_to_layout(x, transpose, dtype), sharding)
    return jax.device_put(x, sharding, may_alias=owned)


def host_to_engine(
    arr: np.ndarray,
    transpose: bool,
    dtype: Any,
    sharding: jax.sharding.Sharding,
    staging: np.ndarray | None = None,
) -> jax.Array:
    """A host array (``arr.T`` if ``transpose``) as ``dtype`` with ``sharding``. On CPU devices
    the array may alias its host copy (``host_copy``, in ``staging`` if given: the caller waits
    for the result before reusing it); elsewhere ``arr`` is sent as it is."""
    cpu = on_cpu(sharding)
    if os.environ.get(HOST_LAYOUT) == "1" and (transpose or arr.dtype != dtype):
        return jax.device_put(host_copy(arr.T if transpose else arr, dtype, staging), sharding)
    if not transpose and arr.dtype == dtype:
        return jax.device_put(host_copy(arr, dtype, staging) if cpu else arr, sharding)
    staged_sharding = _transposed(sharding) if transpose else sharding
    staged = jax.device_put(host_copy(arr, arr.dtype, staging) if cpu else arr, staged_sharding)
    return to_engine(staged, transpose, dtype, sharding)


def _transposed(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """The sharding of a 2-D array's transpose whose transpose has ``sharding``."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (2 - len(tuple(sharding.spec)))
        return NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[::-1]))
    return sharding  # one device (or replicated): the transpose lives where the array does


@functools.cache
def _chunk_writer(sharding: Any, axis: int) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """A jitted, donating ``buf[..., start:start+n, ...] = chunk`` along ``axis`` (in place)."""
    write = lambda buf, chunk, start: jax.lax.dynamic_update_slice_in_dim(buf, chunk, start, axis=axis)  # noqa: E731
    return jax.jit(write, donate_argnums=0, out_shardings=sharding)


def zeros(shape: tuple[int, ...], dtype: Any, sharding: Any) -> jax.Array:
    """Zeros allocated directly with ``sharding`` (no host copy, no full replica)."""
    return _zeros_fn(tuple(shape), jnp.dtype(dtype), sharding)()


@functools.cache
def _zeros_fn(shape: tuple[int, ...], dtype: Any, sharding: Any) -> Callable[[], jax.Array]:
    """One compiled allocator per (shape, dtype, sharding): a resume must not recompile."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


class EngineLeaves:
    """The weight leaves of one engine, addressed by HF name. ``leaves()``: the list the forward
    reads (items replaced in place); ``chunk_bytes``: host tensors above it are written in chunks."""

    def __init__(
        self,
        leaves: Callable[[], list[jax.Array]],
        mappings: Mapping[str, tuple[int, bool]],
        chunk_bytes: int = 64 * 2**20,
    ) -> None:
        self._leaves = leaves
        self.mappings = dict(mappings)
        self.chunk_bytes = chunk_bytes

    @property
    def leaves(self) -> list[jax.Array]:
        return self._leaves()

    def names(self) -> list[str]:
        return list(self.mappings)

    def arrays(self) -> list[jax.Array]:
        """The mapped leaves, in ``names()`` order (deleted ones included)."""
        leaves = self.leaves
        return [leaves[i] for i, _ in self.mappings.values()]

    def target_of(self, hf_name: str) -> jax.Array:
        return self.leaves[self.mappings[hf_name][0]]

    def fingerprint(self, names: Iterable[str] | None = None) -> Fingerprint:
        """(sum, sum of squares) of every mapped leaf (``names``: those)."""
        leaves = self.leaves
        return fingerprint(
            (n, leaves[self.mappings[n][0]]) for n in (self.mappings if names is None else names)
        )

    def place(self, hf_name: str, value: Any) -> jax.Array:
        """``value`` on the leaf's devices in its layout, dtype and sharding (not installed yet)."""
        if hf_name not in self.mappings:
            raise KeyError(f"unknown parameter {hf_name!r} for this engine")
        idx, transpose = self.mappings[hf_name]
        leaf = self.leaves[idx]
        src, owned = unwrap(value)
        if isinstance(src, KernelInOut):  # src.array is the HF tensor's transpose already
            src, transpose = src.array, not transpose
        src = src if isinstance(src, jax.Array) else np.asarray(src)
        _check_shape(hf_name, src.shape[::-1] if transpose else src.shape, leaf.shape)
        if isinstance(src, jax.Array):  # from a trainer: transpose/cast where it lives
            return to_engine(src, transpose, leaf.dtype, leaf.sharding, owned)
        return host_to_engine(src, transpose, leaf.dtype, leaf.sharding)

    def replace_on_host(self, hf_name: str, host: np.ndarray) -> jax.Array:
        """The leaf (on one CPU device: host memory) freed, then ``host`` copied into a buffer of
        its own that becomes the new array (``host_copy``): one copy, and the peak is one copy of
        the tensor where chunks would add a chunk, and XLA:CPU would convert the whole 16-bit
        buffer to float32 and back for each chunk it writes. Not installed yet."""
        idx, transpose = self.mappings[hf_name]
        leaf = self.leaves[idx]
        src = np.asarray(host)
        _check_shape(hf_name, src.shape[::-1] if transpose else src.shape, leaf.shape)
        sharding, dtype = leaf.sharding, leaf.dtype
        leaf.delete()
        return jax.device_put(host_copy(src.T if transpose else src, dtype), sharding)

    def install(self, hf_name: str, new: jax.Array) -> None:
        """Replace the leaf by ``new`` (already placed) and free the old buffer."""
        idx, _ = self.mappings[hf_name]
        leaves = self.leaves
        old = leaves[idx]
        if new.shape != old.shape or new.dtype != old.dtype or new.sharding != old.sharding:
            raise ValueError(f"{hf_name}: placed {new.shape}/{new.dtype} does not match engine leaf")
        leaves[idx] = new
        if old is not new:
            old.delete()

    def stream(
        self, named_tensors: Iterable[tuple[str, Any]], on_tensor: Any = None
    ) -> tuple[dict[str, Sums], int, dict[str, jax.Array]]:
        """Per tensor: place it, dispatch its sums, install it (the old leaf freed at once); host
        ndarrays above ``chunk_bytes`` are written in chunks, or on one CPU device copied whole
        once the old leaf is freed (``replace_on_host``). ``on_tensor(name, nbytes)`` runs at each
        tensor's high point. Returns the sums of what was sent (device scalars), the bytes written
        and, per tensor placed whole, the array summed. Nothing is waited for."""
        sums: dict[str, Sums] = {}
        summed: dict[str, jax.Array] = {}
        nbytes = 0
        for name, value in named_tensors:
            big = isinstance(value, np.ndarray) and self.chunk_axis(name, value) is not None
            if big and (not on_cpu(self.target_of(name).sharding, one=True) or fault("swap_noop")):
                sums[name] = self.write_in_chunks(name, value, on_tensor)
                summed.pop(name, None)  # summed chunk by chunk: only a read-back proves the buffer
                nbytes += self.target_of(name).nbytes
                continue
            if big:
                new = self.replace_on_host(name, value)
            else:
                new = value.value if isinstance(value, Placed) else self.place(name, value)
            sums[name] = tensor_sums(new)  # dispatched async; read back once by the caller
            summed[name] = new
            nbytes += new.nbytes
            if on_tensor is not None:
                on_tensor(name, new.nbytes)  # the high point: new tensor placed, old one still resident
            if fault("swap_noop"):
                new.delete()
            else:
                self.install(name, new)
            del new
        return sums, nbytes, summed

    def installed(self, summed: Mapping[str, jax.Array]) -> frozenset[str]:
        """The names whose leaf is the very array ``stream`` summed: fingerprinted without a read-back."""
        leaves = self.leaves
        return frozenset(n for n, a in summed.items() if leaves[self.mappings[n][0]] is a)

    def chunk_axis(self, hf_name: str, host: Any) -> int | None:
        """Engine-layout axis to stream ``hf_name`` along (unsharded, above ``chunk_bytes``), or None."""
        return self._chunk_axis(hf_name, np.asarray(host).nbytes)

    def _chunk_axis(self, hf_name: str, nbytes: int) -> int | None:
        if self.chunk_bytes <= 0 or nbytes <= self.chunk_bytes:
            return None
        leaf = self.target_of(hf_name)
        spec = getattr(leaf.sharding, "spec", None)
        if spec is None or leaf.ndim != 2:
            return None
        spec = tuple(spec) + (None,) * (leaf.ndim - len(tuple(spec)))
        free = [ax for ax in range(leaf.ndim) if spec[ax] is None]
        return free[0] if free else None

    def write_in_chunks(self, hf_name: str, host: np.ndarray, on_tensor: Any = None) -> Sums:
        """Write ``host`` (HF layout) into the leaf's buffer slice by slice along ``chunk_axis``
        (peak: the buffer plus ``chunk_bytes``). Returns the (sum, sumsq) of the data sent."""
        idx, transpose = self.mappings[hf_name]
        axis = self.chunk_axis(hf_name, host)
        if axis is None:
            raise ValueError(f"{hf_name}: not chunked (at most chunk_bytes, or no unsharded axis)")
        leaves = self.leaves
        buf = leaves[idx]
        src = np.asarray(host)  # HF layout: a chunk is cut from it and transposed on the devices
        _check_shape(hf_name, src.shape[::-1] if transpose else src.shape, buf.shape)
        step = self._chunk_rows(buf, axis, transpose)
        write = _chunk_writer(buf.sharding, axis)
        hf_axis = 1 - axis if transpose else axis
        total_s = total_q = jnp.zeros((), jnp.float32)
        # CPU: every chunk staged in one host buffer (fresh pages cost more than the copy here)
        staging = aligned_empty(src.nbytes // src.shape[hf_axis] * step) if on_cpu(buf.sharding) else None
        for start in range(0, buf.shape[axis], step):
            window = [slice(None)] * src.ndim
            window[hf_axis] = slice(start, min(start + step, buf.shape[axis]))
            part = src[tuple(window)]  # a view of the memmap: runs of contiguous rows
            chunk = host_to_engine(part, transpose, buf.dtype, buf.sharding, staging)
            s, q = tensor_sums(chunk)
            total_s, total_q = total_s + s, total_q + q
            if on_tensor is not None and start == 0:
                on_tensor(hf_name, chunk.nbytes)  # the high point: buffer plus one chunk
            if not fault("swap_noop"):
                buf = write(buf, chunk, jnp.int32(start))
            del chunk
            if staging is not None:  # its readers done before the next chunk overwrites it
                jax.block_until_ready((buf, s, q))
        leaves[idx] = buf
        return total_s, total_q

    def _chunk_rows(self, buf: Any, axis: int, transpose: bool) -> int:
        """Rows of ``buf`` along ``axis`` per chunk; a transposed chunk is on the devices twice."""
        row_bytes = buf.nbytes // buf.shape[axis]
        return max(1, self.chunk_bytes // max(1, row_bytes * (2 if transpose else 1)))


def _check_shape(hf_name: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    """``got``: the tensor's shape in the engine layout."""
    if tuple(got) != tuple(want):
        raise ValueError(f"{hf_name}: shape {tuple(got)} does not match engine {tuple(want)}")

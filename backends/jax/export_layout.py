"""The layout of the weights the JAX trainer exports to an engine.

HF checkpoints store a linear layer's weight as ``[out, in]``; our flax model and sglang-jax
both store its kernel as ``[in, out]``. Transposing to HF layout on export and back on
install would materialise two copies of every kernel for nothing, so the trainer exports a
kernel in its own layout, marked ``KernelInOut``: an engine whose leaf is ``[in, out]``
installs it as is. A consumer that wants the HF tensor makes one explicit ``hf_layout`` call.
Every other exported weight (embeddings, norms) is a plain array in HF layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class KernelInOut(NamedTuple):
    """A kernel ``[in, out]`` whose HF tensor (same name) is ``array.T``, ``[out, in]``."""

    array: jax.Array  # [in, out]


class Owned(NamedTuple):
    """An exported value (a ``jax.Array`` or ``KernelInOut``) in a buffer made for the export
    (a cast of a float32 master): nothing else holds it, so an engine may install that buffer
    instead of copying it."""

    value: Any


def unwrap(value: Any) -> tuple[Any, bool]:
    """(the exported value without ``Owned``, whether it was ``Owned``)."""
    return (value.value, True) if isinstance(value, Owned) else (value, False)


def array_of(value: Any) -> jax.Array:
    """The array of an exported value, in the layout it was sent in (a kernel ``[in, out]``)."""
    value, _ = unwrap(value)
    return value.array if isinstance(value, KernelInOut) else value


def hf_layout(value: Any) -> Any:
    """The HF-layout tensor of an exported value.

    ``KernelInOut(a)`` -> ``a.T`` (``[out, in]``, a transposed copy once materialised); any
    other value is already in HF layout and is returned unchanged (without ``Owned``).
    """
    value, _ = unwrap(value)
    return value.array.T if isinstance(value, KernelInOut) else value

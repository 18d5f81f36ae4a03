"""The layout of the weights the JAX trainer exports to an engine.

HF stores a linear weight as ``[out, in]``; our model and sglang-jax store kernels ``[in, out]``.
Kernels are exported as is, marked ``KernelInOut`` (no transposed copies); ``hf_layout`` makes the
HF tensor on request. Every other weight is a plain array in HF layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax


class KernelInOut(NamedTuple):
    """A kernel ``[in, out]`` whose HF tensor (same name) is ``array.T``, ``[out, in]``."""

    array: jax.Array  # [in, out]


class Owned(NamedTuple):
    """An exported value in a buffer made for the export (a cast of a float32 master): nothing
    else holds it, so an engine may install it without a copy."""

    value: Any


def unwrap(value: Any) -> tuple[Any, bool]:
    """(the exported value without ``Owned``, whether it was ``Owned``)."""
    return (value.value, True) if isinstance(value, Owned) else (value, False)


def array_of(value: Any) -> jax.Array:
    """The array of an exported value, in the layout it was sent in (a kernel ``[in, out]``)."""
    value, _ = unwrap(value)
    return value.array if isinstance(value, KernelInOut) else value


def hf_layout(value: Any) -> Any:
    """The HF-layout tensor of an exported value: ``KernelInOut(a)`` -> ``a.T``, else unchanged."""
    value, _ = unwrap(value)
    return value.array.T if isinstance(value, KernelInOut) else value

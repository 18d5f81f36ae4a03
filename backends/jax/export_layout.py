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


def hf_layout(value: Any) -> Any:
    """The HF-layout tensor of an exported value.

    ``KernelInOut(a)`` -> ``a.T`` (``[out, in]``, a transposed copy once materialised); any
    other value is already in HF layout and is returned unchanged.
    """
    return value.array.T if isinstance(value, KernelInOut) else value

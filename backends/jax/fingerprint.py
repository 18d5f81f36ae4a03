"""Weight fingerprints: (sum, sum of squares) per tensor, in float32 on the device, computed the
same way by the trainer (what it exports) and the engine (what it runs)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp

from mllm_rl.engine import Fingerprint


@jax.jit
def tensor_sums(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum, sum of squares) of ``x`` in float32, as device scalars (dispatched async)."""
    x = x.astype(jnp.float32)
    return jnp.sum(x), jnp.sum(x * x)


def read_sums(sums: Mapping[str, tuple[jax.Array, jax.Array]]) -> Fingerprint:
    """The ``tensor_sums`` of every name, read back to the host in one transfer."""
    host = jax.device_get(dict(sums))
    return {name: (float(s), float(q)) for name, (s, q) in host.items()}


def fingerprint(named_arrays: Iterable[tuple[str, jax.Array]]) -> Fingerprint:
    """Dispatch ``tensor_sums`` of every ``(name, array)``, then read them all back once."""
    return read_sums({name: tensor_sums(x) for name, x in named_arrays})

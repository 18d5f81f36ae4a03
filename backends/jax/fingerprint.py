"""Weight fingerprints: (sum, sum of squares) per tensor, in float32 on the device, computed the
same way by the trainer (what it exports) and the engine (what it runs)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp

from mllm_rl.engine import Fingerprint


def _fused_sums(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    x = x.astype(jnp.float32)
    return jnp.sum(x), jnp.sum(x * x)


def _separate_sums(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two reductions kept apart: XLA:CPU fuses both into one loop that runs many times slower
    than either alone on a large 16-bit tensor (docs/BENCHMARKS.md, param swap)."""
    s = jnp.sum(x.astype(jnp.float32))
    x = jax.lax.optimization_barrier(x)
    return s, jnp.sum(jnp.square(x.astype(jnp.float32)))


@jax.jit
def tensor_sums(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum, sum of squares) of ``x`` in float32, as device scalars (dispatched async)."""
    return jax.lax.platform_dependent(x, cpu=_separate_sums, default=_fused_sums)


def read_sums(sums: Mapping[str, tuple[jax.Array, jax.Array]]) -> Fingerprint:
    """The ``tensor_sums`` of every name, read back to the host in one transfer."""
    host = jax.device_get(dict(sums))
    return {name: (float(s), float(q)) for name, (s, q) in host.items()}


def fingerprint(named_arrays: Iterable[tuple[str, jax.Array]]) -> Fingerprint:
    """Dispatch ``tensor_sums`` of every ``(name, array)``, then read them all back once."""
    return read_sums({name: tensor_sums(x) for name, x in named_arrays})

"""AdamW whose state lives in host memory (``optimizer_memory="host"``): optax's own tree (checkpoints
as the device path's), every leaf on ``pinned_host``.
``apply``: ``StepFns.grad_norm`` on the device, then per trainable leaf its moments are copied in,
``StepFns.leaf_update`` applies clip and AdamW exactly as ``apply`` does, the new moments go back
to the host and the leaf's gradient is deleted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import optax

from mllm_rl.backends.jax.sharding import on_cpu

DEVICE, HOST = "device", "pinned_host"
COMPILED_COPY_BYTES = 32 * 2**20  # JAX CPU: arrays this large move through a compiled copy


def put(tree: Any, kind: str) -> Any:
    """A copy of ``tree``'s arrays in memory kind ``kind``, same sharding (waited for once)."""
    return jax.block_until_ready(jax.tree.map(lambda x: _put(x, kind), tree))


def _put(x: jax.Array, kind: str) -> jax.Array:
    """``x`` in memory kind ``kind``. On JAX CPU an array of ``COMPILED_COPY_BYTES`` or more (whose
    copy lands in fresh pages) moves through XLA's own copy, faster than ``device_put`` there
    (docs/BENCHMARKS.md, step cost); smaller ones need no compile."""
    sharding = x.sharding.with_memory_kind(kind)
    if x.nbytes >= COMPILED_COPY_BYTES and on_cpu(sharding):
        return _copier(sharding)(x)
    return jax.device_put(x, sharding)


@functools.cache
def _copier(sharding: jax.sharding.Sharding) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda a: a, out_shardings=sharding)


def adam_state(opt_state: Any) -> optax.ScaleByAdamState:
    """The ``ScaleByAdamState`` (count, mu, nu) inside ``make_tx``'s chain state."""
    found = _find(opt_state)
    if found is None:
        raise ValueError("optimizer state has no ScaleByAdamState (AdamW)")
    return found


def _find(tree: Any) -> optax.ScaleByAdamState | None:
    if isinstance(tree, optax.ScaleByAdamState):
        return tree
    return next((f for f in map(_find, tree) if f is not None), None) if isinstance(tree, tuple) else None


def _replace_adam(opt_state: Any, new: optax.ScaleByAdamState) -> Any:
    if isinstance(opt_state, optax.ScaleByAdamState):
        return new
    if isinstance(opt_state, tuple):
        parts = [_replace_adam(p, new) if _find(p) is not None else p for p in opt_state]
        return type(opt_state)(*parts) if hasattr(opt_state, "_fields") else tuple(parts)
    return opt_state


def apply(fns: Any, trainable: Any, opt_state: Any, grads: Any) -> tuple[Any, Any, jax.Array]:
    """One AdamW update with ``opt_state`` on the host: ``(trainable, opt_state, grad_norm)`` as
    ``StepFns.apply`` returns them; ``trainable`` donated, ``grads`` and the old state deleted."""
    gnorm = fns.grad_norm(grads)
    adam = adam_state(opt_state)
    params, p_def = jax.tree.flatten(trainable)
    g_leaves = jax.tree.leaves(grads)
    mu, mu_def = jax.tree.flatten(adam.mu)
    nu, nu_def = jax.tree.flatten(adam.nu)
    if not len(params) == len(g_leaves) == len(mu) == len(nu):
        raise ValueError("optimizer state does not match the trainable params")
    count = put(adam.count, DEVICE)
    new_count = count
    for j in range(len(params)):
        m_dev, v_dev = put(mu[j], DEVICE), put(nu[j], DEVICE)
        params[j], m_dev, v_dev, new_count = fns.leaf_update(
            params[j], g_leaves[j], m_dev, v_dev, count, gnorm
        )
        m_host, v_host = put(m_dev, HOST), put(v_dev, HOST)
        for x in (m_dev, v_dev, g_leaves[j], mu[j], nu[j]):
            x.delete()
        mu[j], nu[j] = m_host, v_host
    host_count = put(new_count, HOST)
    count.delete()
    adam.count.delete()
    new = adam._replace(
        count=host_count, mu=jax.tree.unflatten(mu_def, mu), nu=jax.tree.unflatten(nu_def, nu)
    )
    return jax.tree.unflatten(p_def, params), _replace_adam(opt_state, new), gnorm

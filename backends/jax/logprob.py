"""The output head: logits, and log-probabilities of the taken tokens without whole logits.

Shapes: B batch, T positions, H hidden, V vocab, C chunk. ``token_logprobs`` with ``chunk > 0``
computes the head ``C`` positions at a time under ``lax.scan``, rematerialised in the backward, so
at most [B, C, V] float32 logits exist at once; it takes the sampling temperature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def head_logits(x: jax.Array, head: jax.Array) -> jax.Array:
    """``x`` [..., H] @ ``head`` [V, H]^T -> logits [..., V] float32."""
    return (x @ head.T).astype(jnp.float32)


def _logp(x: jax.Array, head: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """``x`` [B, C, H], ``targets`` [B, C] -> log softmax(logits / temperature)[targets] [B, C] float32."""
    logits = head_logits(x, head)
    if temperature != 1.0:
        logits = logits / jnp.float32(temperature)
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return tgt - jax.nn.logsumexp(logits, axis=-1)


def token_logprobs(
    x: jax.Array, head: jax.Array, targets: jax.Array, chunk: int = 0, temperature: float = 1.0
) -> jax.Array:
    """``x`` [B, T, H] hidden states, ``targets`` [B, T] int -> [B, T] float32
    ``log softmax((x @ head^T) / temperature)[targets]``, ``chunk`` positions at a time (0: all)."""
    b, t, h = x.shape
    if chunk <= 0 or chunk >= t:
        return _logp(x, head, targets, temperature)
    n = -(-t // chunk)
    pad = n * chunk - t
    xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(b, n, chunk, h).swapaxes(0, 1)  # [n, B, C, H]
    ts = jnp.pad(targets, ((0, 0), (0, pad))).reshape(b, n, chunk).swapaxes(0, 1)  # [n, B, C]
    one = jax.checkpoint(lambda xc, hd, tc: _logp(xc, hd, tc, temperature), prevent_cse=False)

    def body(carry: None, xt: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        return None, one(xt[0], head, xt[1])

    _, out = jax.lax.scan(body, None, (xs, ts))  # [n, B, C]
    return out.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]

"""Causal self-attention with a key-padding mask, four ways (``ModelOptions.attention``).

Shapes: B batch, T positions, N query heads, K kv heads (N % K == 0), D head dim, C query chunk.
Every implementation takes ``q`` [B, T, N, D], ``k``/``v`` [B, T, K, D] and ``attn`` [B, T] bool
(True on real tokens) and returns [B, T, N, D] in ``v``'s dtype. Query ``t`` attends to keys
``s <= t`` with ``attn[b, s]``; scores and softmax in float32.

``dense``: the reference ([B, N, T, T] scores); ``xla``: ``jax.nn.dot_product_attention``;
``chunked``: query chunks under ``lax.scan``, rematerialised (at most [B, N, C, T] scores);
``splash``: the Pallas TPU kernel under ``shard_map`` (interpreted on CPU for tests). A padding
row gives finite garbage (never NaN), masked out of every loss.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

IMPLEMENTATIONS = ("dense", "xla", "chunked", "splash")
NEG = float(jnp.finfo(jnp.float32).min)


def causal_mask(attn: jax.Array) -> jax.Array:
    """``attn`` [B, T] -> [B, 1, T, T] bool: query t may see key s."""
    t = attn.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    return causal[None, None] & attn[:, None, None, :]


def dense(q: jax.Array, k: jax.Array, v: jax.Array, attn: jax.Array) -> jax.Array:
    """The reference: ``softmax(q k^T / sqrt(D) masked) v`` with the full score matrix."""
    b, t, n, d = q.shape
    rep = n // k.shape[2]
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    scores = jnp.einsum("btnd,bsnd->bnts", q, k).astype(jnp.float32) / np.sqrt(d)
    scores = jnp.where(causal_mask(attn), scores, NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bnts,bsnd->btnd", probs, v)


def xla(q: jax.Array, k: jax.Array, v: jax.Array, attn: jax.Array) -> jax.Array:
    """``jax.nn.dot_product_attention`` with the same mask (grouped-query handled natively)."""
    out = jax.nn.dot_product_attention(q, k, v, mask=causal_mask(attn), scale=1.0 / np.sqrt(q.shape[-1]))
    return out.astype(v.dtype)


def chunked(q: jax.Array, k: jax.Array, v: jax.Array, attn: jax.Array, chunk: int) -> jax.Array:
    """Query chunks of ``chunk`` positions (T padded up to a multiple), one at a time."""
    b, t, n, d = q.shape
    kh = k.shape[2]
    rep = n // kh
    c = min(chunk, t)
    tp = -(-t // c) * c
    qp = jnp.pad(q, ((0, 0), (0, tp - t), (0, 0), (0, 0))).reshape(b, tp // c, c, kh, rep, d)
    qp = jnp.moveaxis(qp, 1, 0)  # [T/C, B, C, K, rep, D]
    key_ok = attn[:, None, None, None, :]  # [B, 1, 1, 1, T]
    scale = 1.0 / np.sqrt(d)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one(qc: jax.Array, start: jax.Array) -> jax.Array:
        """``qc`` [B, C, K, rep, D] at query positions start .. start + C -> [B, C, K, rep, D]."""
        s = jnp.einsum("bckrd,bskd->bkrcs", qc, k).astype(jnp.float32) * scale  # [B, K, rep, C, T]
        qpos = start + jnp.arange(c)
        ok = (jnp.arange(t)[None, :] <= qpos[:, None])[None, None, None] & key_ok
        probs = jax.nn.softmax(jnp.where(ok, s, NEG), axis=-1).astype(v.dtype)
        return jnp.einsum("bkrcs,bskd->bckrd", probs, v)

    def body(carry: None, xs: tuple[jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        return None, one(*xs)

    _, out = jax.lax.scan(body, None, (qp, jnp.arange(tp // c) * c))
    out = jnp.moveaxis(out, 0, 1).reshape(b, tp, n, d)
    return out[:, :t]


def splash(
    q: jax.Array, k: jax.Array, v: jax.Array, attn: jax.Array, mesh: Mesh | None, interpret: bool = False
) -> jax.Array:
    """Pallas splash attention: T padded to a multiple of 128; padding keys get segment 0,
    real tokens segment 1 (a real query sees only real keys; padding sees padding)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t, n, d = q.shape
    tp = -(-t // 128) * 128
    pad = ((0, 0), (0, tp - t), (0, 0), (0, 0))
    # [B, heads, T, D], q scaled here (the kernel does not scale).
    qh = jnp.moveaxis(jnp.pad(q * jnp.asarray(1.0 / np.sqrt(d), q.dtype), pad), 2, 1)
    kh, vh = (jnp.moveaxis(jnp.pad(x, pad), 2, 1) for x in (k, v))
    seg = jnp.pad(attn.astype(jnp.int32), ((0, 0), (0, tp - t)))  # [B, Tp]
    bl = next(bl for bl in (512, 256, 128) if tp % bl == 0)
    blocks = "block_q block_kv block_kv_compute block_q_dkv block_kv_dkv block_kv_dkv_compute block_q_dq block_kv_dq"
    sizes = sk.BlockSizes(**dict.fromkeys(blocks.split(), bl))

    def local(qh: jax.Array, kh: jax.Array, vh: jax.Array, seg: jax.Array) -> jax.Array:
        heads = qh.shape[1]
        mask = sm.MultiHeadMask([sm.CausalMask((tp, tp)) for _ in range(heads)])
        kernel = sk.make_splash_mha(
            mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
        )
        one = lambda q1, k1, v1, s1: kernel(q1, k1, v1, sk.SegmentIds(s1, s1))  # noqa: E731
        return jax.vmap(one)(qh, kh, vh, seg)

    if mesh is not None and mesh.size > 1:
        fsdp, tpn = mesh.shape["fsdp"], mesh.shape["tp"]
        bax = "fsdp" if fsdp > 1 and b % fsdp == 0 else None
        hax = "tp" if tpn > 1 and n % tpn == 0 and k.shape[2] % tpn == 0 else None
        spec = P(bax, hax)
        local = jax.shard_map(
            local, mesh=mesh, in_specs=(spec, spec, spec, P(bax)), out_specs=spec, check_vma=False
        )
    out = local(qh, kh, vh, seg)  # [B, N, Tp, D]
    return jnp.moveaxis(out, 1, 2)[:, :t].astype(v.dtype)


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    attn: jax.Array,
    impl: str = "dense",
    chunk: int = 512,
    mesh: Mesh | None = None,
    interpret: bool = False,
) -> jax.Array:
    """Dispatch to ``impl`` (see the module docstring)."""
    if impl == "dense":
        return dense(q, k, v, attn)
    if impl == "xla":
        return xla(q, k, v, attn)
    if impl == "chunked":
        return chunked(q, k, v, attn, chunk)
    if impl == "splash":
        return splash(q, k, v, attn, mesh, interpret)
    raise ValueError(
        f"attention: unknown implementation {impl!r}; choose one of {', '.join(IMPLEMENTATIONS)}"
    )

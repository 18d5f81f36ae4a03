"""Qwen3 causal LM in flax nnx: the trainer's model and the independent reference that
proves an engine's weights (HF names, HF math).

Shapes: B batch, T sequence, H hidden, N heads, K kv heads, D head_dim, V vocab, I mlp,
R LoRA rank. Linear kernels are stored ``(in, out)`` (the HF ``(out, in)`` matrix
transposed). With ``lora_rank > 0`` every linear layer also holds ``lora_a`` [in, R] and
``lora_b`` [R, out] (``LoRAParam``; b starts at zero so the model starts as the base) and
computes ``x @ kernel + (x @ lora_a @ lora_b) * alpha / R``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.presets import ModelConfig


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: jnp.dtype) -> None:
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x``: [..., dim] -> [..., dim]; normalised in float32."""
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...].astype(jnp.float32)).astype(x.dtype)


@jax.jit
def merge_lora(kernel: jax.Array, a: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
    """``kernel + a @ b * scale`` computed in float32, [in, out] in the kernel's dtype."""
    delta = (a.astype(jnp.float32) @ b.astype(jnp.float32)) * scale
    return (kernel.astype(jnp.float32) + delta).astype(kernel.dtype)


class LoRAParam(nnx.Param):
    """A trainable low-rank adapter weight (the base ``Param``s stay frozen in LoRA mode)."""


class Linear(nnx.Module):
    def __init__(self, d_in: int, d_out: int, dtype: jnp.dtype) -> None:
        self.kernel = nnx.Param(jnp.zeros((d_in, d_out), dtype))
        self.lora_a: LoRAParam | None = nnx.data(None)
        self.lora_b: LoRAParam | None = nnx.data(None)
        self.lora_scale = 0.0

    def add_lora(self, rank: int, alpha: float, key: jax.Array) -> None:
        """Attach adapters: ``lora_a`` ~ N(0, 1/in), ``lora_b`` = 0 (output unchanged)."""
        d_in, d_out = self.kernel.shape
        dtype = self.kernel.dtype
        self.lora_a = LoRAParam(jax.random.normal(key, (d_in, rank), dtype) / np.sqrt(d_in))
        self.lora_b = LoRAParam(jnp.zeros((rank, d_out), dtype))
        self.lora_scale = alpha / rank

    def merged_kernel(self) -> jax.Array:
        """[in, out]: the kernel an engine without adapters must hold."""
        if self.lora_a is None:
            return self.kernel[...]
        return merge_lora(self.kernel[...], self.lora_a[...], self.lora_b[...], jnp.float32(self.lora_scale))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...]
        if self.lora_a is not None:
            y = y + ((x @ self.lora_a[...]) @ self.lora_b[...]) * self.lora_scale
        return y


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Neox-style rotary embedding. ``x``: [B, T, N, D], ``positions``: [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [D/2]
    ang = positions[..., None].astype(jnp.float32) * inv  # [B, T, D/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : d // 2], x32[..., d // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, c: ModelConfig, dtype: jnp.dtype) -> None:
        self.c = c
        d = c.head_dim
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * d, dtype)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * d, dtype)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * d, dtype)
        self.o_proj = Linear(c.num_attention_heads * d, c.hidden_size, dtype)
        self.q_norm = RMSNorm(d, c.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(d, c.rms_norm_eps, dtype)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        """``x``: [B, T, H]; ``mask``: [B, 1, T, T] bool (True = attend) -> [B, T, H]."""
        c = self.c
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, c.num_attention_heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim))
        v = self.v_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
        scores = jnp.einsum("btnd,bsnd->bnts", q, k).astype(jnp.float32) / np.sqrt(c.head_dim)
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bnts,bsnd->btnd", probs, v).reshape(b, t, -1)
        return self.o_proj(out)


class MLP(nnx.Module):
    def __init__(self, c: ModelConfig, dtype: jnp.dtype) -> None:
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, dtype)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, dtype)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    def __init__(self, c: ModelConfig, dtype: jnp.dtype) -> None:
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.self_attn = Attention(c, dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.mlp = MLP(c, dtype)

    def __call__(self, x: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3(nnx.Module):
    """``Qwen3(config)(tokens [B, T], attention_mask [B, T]) -> logits [B, T, V]`` (float32)."""

    def __init__(self, c: ModelConfig, dtype: jnp.dtype = jnp.float32) -> None:
        self.config = c
        self.embed_tokens = nnx.Param(jnp.zeros((c.vocab_size, c.hidden_size), dtype))
        self.layers = nnx.List([Block(c, dtype) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        self.lm_head = (
            None if c.tie_word_embeddings else nnx.Param(jnp.zeros((c.vocab_size, c.hidden_size), dtype))
        )

    def __call__(self, tokens: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        b, t = tokens.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), bool)
        attention_mask = attention_mask.astype(bool)
        positions = jnp.maximum(jnp.cumsum(attention_mask, axis=1) - 1, 0)  # left padding aware
        causal = jnp.tril(jnp.ones((t, t), bool))
        mask = causal[None, None] & attention_mask[:, None, None, :]
        x = self.embed_tokens[...][tokens]
        for layer in self.layers:
            x = layer(x, positions, mask)
        x = self.norm(x)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return (x @ head[...].T).astype(jnp.float32)


def linear_layers(model: Qwen3) -> dict[str, Linear]:
    """HF weight name -> the ``Linear`` holding it (every projection of every layer)."""
    out = {}
    for i, layer in enumerate(model.layers):
        for sub, names in (("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
                           ("mlp", ("gate_proj", "up_proj", "down_proj"))):  # fmt: skip
            for n in names:
                out[f"model.layers.{i}.{sub}.{n}.weight"] = getattr(getattr(layer, sub), n)
    return out


def add_lora(model: Qwen3, rank: int, alpha: float, seed: int = 0) -> None:
    """Attach LoRA adapters of ``rank`` to every linear layer (in place)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    key = jax.random.key(seed)
    for i, lin in enumerate(linear_layers(model).values()):
        lin.add_lora(rank, alpha, jax.random.fold_in(key, i))


def hf_path(name: str) -> tuple[tuple[str | int, ...], bool]:
    """HF parameter name -> (attribute path in ``Qwen3``, stored transposed?)."""
    parts = name.split(".")
    if name == "model.embed_tokens.weight":
        return ("embed_tokens",), False
    if name == "lm_head.weight":
        return ("lm_head",), False
    if name == "model.norm.weight":
        return ("norm", "weight"), False
    # model.layers.{i}.<sub>.<proj>.weight
    i, rest = int(parts[2]), parts[3:-1]
    if rest[-1].endswith("_proj"):
        return ("layers", i, *rest, "kernel"), True
    return ("layers", i, *rest, "weight"), False


def load_qwen3(model_dir: ModelDir, dtype: jnp.dtype | None = None) -> Qwen3:
    """Build a ``Qwen3`` and stream the checkpoint into it, one tensor at a time."""
    c = model_dir.config
    if dtype is None:
        dtype = jnp.float32 if next(iter(model_dir.tensors.values()))[1].dtype == "F32" else jnp.bfloat16
    model = nnx.eval_shape(lambda: Qwen3(c, dtype))
    for name, arr in model_dir.iter_tensors():
        path, transpose = hf_path(name)
        obj = model
        for p in path[:-1]:
            obj = obj[p] if isinstance(p, int) else getattr(obj, p)
        # A copy, never the memmap itself: jax on CPU would alias the file mapping (see
        # ``sglang_engine.host_copy``).
        host = np.array(arr, copy=True)
        host = host.T if transpose else host
        var = getattr(obj, path[-1])
        if tuple(var.shape) != host.shape:
            raise ValueError(f"{name}: checkpoint {host.shape} vs model {tuple(var.shape)}")
        setattr(obj, path[-1], nnx.Param(jnp.asarray(host, dtype)))
    return model


def greedy_decode(model: Qwen3, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Reference greedy decoding by full re-forward each step (no KV cache).

    Returns (generated token ids [T_out], their log-probabilities [T_out]).
    """
    fwd = nnx.jit(lambda m, x: jax.nn.log_softmax(m(x)[:, -1], axis=-1))
    ids = list(prompt)
    out, lps = [], []
    for _ in range(max_new_tokens):
        lp = np.asarray(fwd(model, jnp.asarray([ids], jnp.int32))[0])
        tok = int(lp.argmax())
        out.append(tok)
        lps.append(float(lp[tok]))
        ids.append(tok)
        if tok == model.config.eos_token_id:
            break
    return out, lps

"""Qwen3 causal LM in flax nnx: the trainer's model and the reference for an engine's weights.

Shapes: B batch, T sequence, H hidden, N heads, K kv heads, D head_dim, V vocab, I mlp,
R LoRA rank. Linear kernels are stored ``(in, out)``. With ``lora_rank > 0`` every linear layer
also holds ``lora_a`` [in, R] and ``lora_b`` [R, out] (b starts at zero) and computes
``x @ kernel + (x @ lora_a @ lora_b) * alpha / R``.

Layouts: a list of L ``Block``s run in a Python loop, or (``scan_layers``) one ``Block`` whose
variables are stacked [L, ...] under ``jax.lax.scan``; HF names address both (``hf_path``). How
a forward pass runs is its ``Run``; the default ``Run()`` is the reference math.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from mllm_rl.backends.jax.attention import attention
from mllm_rl.backends.jax.options import ModelOptions
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.presets import ModelConfig
from mllm_rl.trainer import greedy_loop


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
    ``log softmax((x @ head^T) / temperature)[targets]`` without whole logits: ``chunk`` > 0
    positions at a time under ``lax.scan``, rematerialised in the backward (at most [B, C, V])."""
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

    def add_lora(self, rank: int, alpha: float, key: jax.Array, dtype: Any = None) -> None:
        """Attach adapters in ``dtype`` (default: the kernel's): ``lora_a`` ~ N(0, 1/in) drawn in
        float32, ``lora_b`` = 0. A stacked kernel [L, in, out] takes ``key`` [L]."""
        *lead, d_in, d_out = self.kernel.shape
        dtype = self.kernel.dtype if dtype is None else jnp.dtype(dtype)
        draw = lambda k: (jax.random.normal(k, (d_in, rank), jnp.float32) / np.sqrt(d_in)).astype(dtype)  # noqa: E731
        self.lora_a = LoRAParam(jax.vmap(draw)(key) if lead else draw(key))
        self.lora_b = LoRAParam(jnp.zeros((*lead, rank, d_out), dtype))
        self.lora_scale = alpha / rank

    def merged_kernel(self) -> jax.Array:
        """[in, out]: the kernel an engine without adapters must hold."""
        if self.lora_a is None:
            return self.kernel[...]
        return merge_lora(self.kernel[...], self.lora_a[...], self.lora_b[...], jnp.float32(self.lora_scale))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` [..., in] -> [..., out] in the dtype of ``x @ kernel`` (the LoRA branch too)."""
        y = x @ self.kernel[...]
        if self.lora_a is not None:
            a, b = self.lora_a[...].astype(y.dtype), self.lora_b[...].astype(y.dtype)
            y = y + ((x.astype(y.dtype) @ a) @ b) * self.lora_scale
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

    def __call__(self, x: jax.Array, positions: jax.Array, attn: jax.Array, run: Run) -> jax.Array:
        """``x``: [B, T, H]; ``attn``: [B, T] bool (True = real token) -> [B, T, H]."""
        c = self.c
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, c.num_attention_heads, c.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim))
        v = self.v_proj(x).reshape(b, t, c.num_key_value_heads, c.head_dim)
        q, k = rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta)
        out = attention(q, k, v, attn, run.opts.attention, run.opts.attention_chunk, run.mesh, run.interpret)
        return self.o_proj(out.reshape(b, t, -1))


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

    def __call__(self, x: jax.Array, positions: jax.Array, attn: jax.Array, run: Run) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x), positions, attn, run)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclasses.dataclass(frozen=True)
class Run:
    """How a forward pass runs: the options, the mesh (``splash`` shards by it) and Pallas interpret
    mode (tests). With ``opts.compute_dtype`` every weight is cast to it where it is used, so every
    matmul runs in that dtype; without it, in the params' own dtype."""

    opts: ModelOptions = ModelOptions()
    mesh: Mesh | None = None
    interpret: bool = False


REMAT_POLICIES = {
    "block": None,  # save nothing but the block's input
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep projection outputs
}


def cast_floats(tree: Any, dtype: Any) -> Any:
    """``tree`` with every floating leaf in ``dtype`` (None: unchanged; a leaf in it is not copied)."""
    if dtype is None:
        return tree
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


def _block_fn(graphdef: Any, run: Run, positions: jax.Array, attn: jax.Array) -> Any:
    """``(x [B, T, H], layer state) -> x`` of one block, cast to the compute dtype inside, remat per ``run``."""
    cdt = run.opts.compute_jnp_dtype()

    def f(x: jax.Array, state: Any) -> jax.Array:
        return nnx.merge(graphdef, cast_floats(state, cdt))(x, positions, attn, run)

    if run.opts.remat == "none":
        return f
    return jax.checkpoint(f, policy=REMAT_POLICIES[run.opts.remat], prevent_cse=not run.opts.scan_layers)


class Qwen3(nnx.Module):
    """``Qwen3(config)(tokens [B, T], attention_mask [B, T]) -> logits [B, T, V]`` (float32);
    ``scan_layers``: one stacked ``Block`` [L, ...] under ``jax.lax.scan`` (compile time flat in depth)."""

    def __init__(self, c: ModelConfig, dtype: jnp.dtype = jnp.float32, scan_layers: bool = False) -> None:
        self.config = c
        self.scan_layers = scan_layers
        self.embed_tokens = nnx.Param(jnp.zeros((c.vocab_size, c.hidden_size), dtype))
        if scan_layers:
            graphdef, state = nnx.split(Block(c, dtype))
            stacked = jax.tree.map(lambda a: jnp.zeros((c.num_hidden_layers, *a.shape), a.dtype), state)
            self.layers: Any = nnx.merge(graphdef, stacked)
        else:
            self.layers = nnx.List([Block(c, dtype) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype)
        tied = c.tie_word_embeddings
        self.lm_head = None if tied else nnx.Param(jnp.zeros((c.vocab_size, c.hidden_size), dtype))

    def head(self) -> jax.Array:
        """[V, H]: the output projection (the embedding when tied)."""
        return (self.embed_tokens if self.lm_head is None else self.lm_head)[...]

    def hidden(
        self, tokens: jax.Array, attention_mask: jax.Array | None = None, run: Run = Run()
    ) -> jax.Array:
        """``tokens`` [B, T] -> final-norm hidden states [B, T, H] (compute dtype)."""
        b, t = tokens.shape
        if attention_mask is None:
            attention_mask = jnp.ones((b, t), bool)
        attn = attention_mask.astype(bool)
        positions = jnp.maximum(jnp.cumsum(attn, axis=1) - 1, 0)  # left padding aware
        cdt = run.opts.compute_jnp_dtype()
        x = cast_floats(self.embed_tokens[...][tokens], cdt)  # gather, then cast the rows only
        if self.scan_layers:
            graphdef, state = nnx.split(self.layers)
            step = _block_fn(graphdef, run, positions, attn)
            x, _ = jax.lax.scan(lambda h, s: (step(h, s), None), x, state)
        else:
            for layer in self.layers:
                graphdef, state = nnx.split(layer)
                x = _block_fn(graphdef, run, positions, attn)(x, state)
        norm_graph, norm_state = nnx.split(self.norm)
        return nnx.merge(norm_graph, cast_floats(norm_state, cdt))(x)

    def __call__(
        self, tokens: jax.Array, attention_mask: jax.Array | None = None, run: Run = Run()
    ) -> jax.Array:
        x = self.hidden(tokens, attention_mask, run)
        return head_logits(x, cast_floats(self.head(), run.opts.compute_jnp_dtype()))


LINEAR_SUBS = (
    ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("mlp", ("gate_proj", "up_proj", "down_proj")),
)


class LayerLinear:
    """One layer's slice of a stacked ``Linear`` (``scan_layers``): the same read interface."""

    def __init__(self, linear: Linear, i: int) -> None:
        self.linear, self.i = linear, i
        self.lora_scale = linear.lora_scale

    @property
    def kernel(self) -> jax.Array:
        return self.linear.kernel[self.i]

    @property
    def lora_a(self) -> jax.Array | None:
        return None if self.linear.lora_a is None else self.linear.lora_a[self.i]

    @property
    def lora_b(self) -> jax.Array | None:
        return None if self.linear.lora_b is None else self.linear.lora_b[self.i]

    def merged_kernel(self) -> jax.Array:
        if self.lora_a is None:
            return self.kernel
        return merge_lora(self.kernel, self.lora_a, self.lora_b, jnp.float32(self.lora_scale))


def linear_layers(model: Qwen3) -> dict[str, Linear | LayerLinear]:
    """HF weight name -> the ``Linear`` holding it (stacked layers: a ``LayerLinear`` view)."""
    out: dict[str, Linear | LayerLinear] = {}
    scan = model.scan_layers
    for i in range(model.config.num_hidden_layers):
        for sub, names in LINEAR_SUBS:
            for n in names:
                lin = getattr(getattr(model.layers if scan else model.layers[i], sub), n)
                out[f"model.layers.{i}.{sub}.{n}.weight"] = LayerLinear(lin, i) if scan else lin
    return out


def add_lora(model: Qwen3, rank: int, alpha: float, seed: int = 0, dtype: Any = None) -> None:
    """Attach LoRA adapters of ``rank`` to every linear layer (in place), stored in ``dtype``;
    adapter ``j`` (``linear_layers`` order) draws from ``fold_in(key(seed), j)`` in both layouts."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    key = jax.random.key(seed)
    subs = [(sub, n) for sub, names in LINEAR_SUBS for n in names]
    for j, (sub, n) in enumerate(subs):
        if model.scan_layers:
            idx = jnp.arange(model.config.num_hidden_layers) * len(subs) + j
            keys = jax.vmap(lambda i: jax.random.fold_in(key, i))(idx)
            getattr(getattr(model.layers, sub), n).add_lora(rank, alpha, keys, dtype)
        else:
            for i, layer in enumerate(model.layers):
                lin = getattr(getattr(layer, sub), n)
                lin.add_lora(rank, alpha, jax.random.fold_in(key, i * len(subs) + j), dtype)


_TOP_PATHS: dict[str, tuple[str | int, ...]] = {
    "model.embed_tokens.weight": ("embed_tokens",),
    "lm_head.weight": ("lm_head",),
    "model.norm.weight": ("norm", "weight"),
}


def hf_path(name: str) -> tuple[tuple[str | int, ...], bool]:
    """HF parameter name -> (attribute path in a ``Qwen3`` with a list of layers, stored transposed?)."""
    if name in _TOP_PATHS:
        return _TOP_PATHS[name], False
    parts = name.split(".")  # model.layers.{i}.<sub>.<proj>.weight
    i, rest = int(parts[2]), parts[3:-1]
    if rest[-1].endswith("_proj"):
        return ("layers", i, *rest, "kernel"), True
    return ("layers", i, *rest, "weight"), False


def _owner(model: Qwen3, path: tuple[str | int, ...]) -> tuple[Any, str, int | None]:
    """(the module holding the variable at ``path``, its attribute, the layer row if stacked)."""
    obj: Any = model
    row = None
    for p in path[:-1]:
        if isinstance(p, int):
            if model.scan_layers:
                row = p
            else:
                obj = obj[p]
        else:
            obj = getattr(obj, p)
    return obj, str(path[-1]), row


def get_weight(model: Qwen3, name: str) -> tuple[jax.Array, bool]:
    """The weight ``name`` as stored (a stacked layer's row), and whether HF's is its transpose."""
    path, transpose = hf_path(name)
    obj, attr, row = _owner(model, path)
    value = getattr(obj, attr)[...]
    return (value if row is None else value[row]), transpose


@functools.partial(jax.jit, donate_argnums=0)
def _set_row(stacked: jax.Array, row: jax.Array, value: jax.Array) -> jax.Array:
    return stacked.at[row].set(value)


def model_dir_dtype(model_dir: ModelDir) -> jnp.dtype:
    """The dtype of ``model_dir``'s tensors (float32 for ``F32``, else bfloat16)."""
    return jnp.dtype(
        jnp.float32 if next(iter(model_dir.tensors.values()))[1].dtype == "F32" else jnp.bfloat16
    )


def load_qwen3(model_dir: ModelDir, dtype: jnp.dtype | None = None, scan_layers: bool = False) -> Qwen3:
    """Build a ``Qwen3`` and stream the checkpoint into it, one tensor at a time."""
    c = model_dir.config
    dtype = model_dir_dtype(model_dir) if dtype is None else dtype
    model = nnx.eval_shape(lambda: Qwen3(c, dtype, scan_layers))
    for name, arr in model_dir.iter_tensors():
        path, transpose = hf_path(name)
        obj, attr, row = _owner(model, path)
        # a copy, never the memmap: jax on CPU would alias the file mapping
        host = np.array(arr, copy=True)
        host = host.T if transpose else host
        var = getattr(obj, attr)
        want = tuple(var.shape) if row is None else tuple(var.shape[1:])
        if want != host.shape:
            raise ValueError(f"{name}: checkpoint {host.shape} vs model {want}")
        if row is None:
            setattr(obj, attr, nnx.Param(jnp.asarray(host, dtype)))
            continue
        if isinstance(var.get_value(), jax.ShapeDtypeStruct):  # first layer: allocate the stack
            setattr(obj, attr, nnx.Param(jnp.zeros(var.shape, dtype)))
        stacked = getattr(obj, attr)
        stacked.set_value(_set_row(stacked.get_value(), jnp.int32(row), jnp.asarray(host, dtype)))
    return model


def greedy_decode(model: Qwen3, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Reference greedy decoding by full re-forward: (token ids [T_out], their log-probs [T_out])."""
    fwd = nnx.jit(lambda m, x: jax.nn.log_softmax(m(x)[:, -1], axis=-1))

    def step(ids: list[int]) -> tuple[int, float]:
        lp = np.asarray(fwd(model, jnp.asarray([ids], jnp.int32))[0])
        tok = int(lp.argmax())
        return tok, float(lp[tok])

    return greedy_loop(step, prompt, max_new_tokens, model.config.eos_token_id)

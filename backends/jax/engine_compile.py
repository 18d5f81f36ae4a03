"""sglang-jax's model forward (prefill or decode) lowered and compiled for a target, from shapes.

What sglang-jax's ``ModelRunner`` jits (``jitted_run_model``) is built here with every array
abstract and compiled by the target's compiler. ``_as_target`` swaps sglang-jax's ``device_array``,
KV allocator and ``jax.devices()`` for the trace only; the batch is its own precompile's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Iterator
from typing import Any

from mllm_rl.backends.jax import engine_layout
from mllm_rl.presets import ModelConfig

MODES = ("extend", "decode")
# Layers a plan compiles the forward with: a forward's extra bytes do not grow with depth
# (tests/jax/test_engine_attention.py), its lowering time does.
COMPILED_LAYERS = 2
# KV slots per request an ``fa`` forward is compiled with: its lowering grows with them, its
# extra bytes do not.
FA_SLOTS_PER_REQUEST = 256


@dataclasses.dataclass(frozen=True)
class ForwardShape:
    """One engine forward (``extend`` or ``decode``) and the KV slots it may read."""

    mode: str
    batch: int
    tokens: int
    cache_locs: int
    pool_tokens: int

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"ForwardShape.mode {self.mode!r}: one of {', '.join(MODES)}")
        if not 1 <= self.batch <= self.tokens or self.cache_locs < self.batch:
            raise ValueError(
                f"ForwardShape: batch {self.batch}, tokens {self.tokens}, cache_locs {self.cache_locs}"
            )

    def describe(self) -> str:
        return (
            f"{self.mode} batch {self.batch}, {self.tokens} tokens, {self.cache_locs} KV slots read, "
            f"pool {self.pool_tokens} tokens"
        )


def shapes(
    model: ModelConfig, rows: int, seq_len: int, pool_tokens: int, max_running_requests: int, attention: str
) -> list[ForwardShape]:
    """The rollout's two forwards as sglang-jax runs them: a prefill chunk and a decode step of its
    padded batch bucket, each reading up to ``seq_len`` KV slots per request (``fa``: at most
    ``FA_SLOTS_PER_REQUEST``, the kernel reading the pool in place)."""
    bucket = engine_layout.batch_bucket(rows, max_running_requests)
    tokens = max(min(engine_layout.CHUNKED_PREFILL_TOKENS, rows * seq_len), bucket)
    per_request = min(seq_len, FA_SLOTS_PER_REQUEST) if attention == "fa" else seq_len
    locs = max(bucket, min(bucket * per_request, pool_tokens))
    return [
        ForwardShape("extend", bucket, tokens, locs, pool_tokens),
        ForwardShape("decode", bucket, bucket, locs, pool_tokens),
    ]


def lower(
    model: ModelConfig, devices: list[Any], tp: int, attention: str, shape: ForwardShape, layers: int = 0
) -> Any:
    """``jax.stages.Lowered`` of sglang-jax's ``jitted_run_model`` for ``shape`` on the first ``tp``
    of ``devices``, with the ``attention`` backend; ``layers`` > 0: that many of the model's layers."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from sgl_jax.srt.layers import logits_processor as lp
    from sgl_jax.srt.managers.schedule_batch import ForwardMode
    from sgl_jax.srt.mem_cache.memory_pool import MemoryPools, MHATokenToKVPool
    from sgl_jax.srt.model_executor import forward_batch_info as fbi
    from sgl_jax.srt.model_executor.compilation_manager import CompilationManager
    from sgl_jax.srt.models.qwen3 import Qwen3ForCausalLM

    if layers:
        model = dataclasses.replace(model, num_hidden_layers=min(layers, model.num_hidden_layers))
    mesh = engine_layout.engine_mesh(devices, tp)
    dtype = jnp.dtype(engine_layout.engine_dtype(model))
    head_dim = -(-model.head_dim // 128) * 128
    with _as_target(devices[:tp]), jax.set_mesh(mesh):
        abstract = nnx.eval_shape(
            lambda: Qwen3ForCausalLM(engine_layout._hf_config(model), mesh=mesh, dtype=dtype)
        )
        gdef, state = nnx.split(abstract)
        leaves, sdef = jax.tree_util.tree_flatten(state)
        kv_heads, layers_n = max(model.num_key_value_heads, tp), model.num_hidden_layers
        pool = MHATokenToKVPool(
            shape.pool_tokens, engine_layout.PAGE_SIZE, dtype, kv_heads, head_dim, layers_n, mesh
        )
        manager = types.SimpleNamespace(
            vocab_size=model.vocab_size,
            capture_hidden_states=False,
            has_recurrent_state=False,
            supports_recurrent_cow=False,
            supports_recurrent_track=False,
        )
        mode = ForwardMode.EXTEND if shape.mode == "extend" else ForwardMode.DECODE
        batch = CompilationManager._make_dummy_batch(
            manager, shape.batch, shape.tokens, mode, shape.cache_locs, dp_size=1, per_dp_bs_size=shape.batch
        )
        attn = _attention(attention, model, head_dim, mesh)
        attn.forward_metadata = attn.get_forward_metadata(batch)
        hf_config = types.SimpleNamespace(architectures=["Qwen3ForCausalLM"])
        config = types.SimpleNamespace(is_embedding=False, hf_config=hf_config)
        runner = types.SimpleNamespace(mesh=mesh, attn_backend=attn, model=abstract, model_config=config)
        forward_batch = fbi.ForwardBatch.init_new(batch, runner)
        logits_meta = lp.LogitsMetadata.from_model_worker_batch(batch, mesh)

        def run(leaves: list[Any], forward_batch: Any, pools: Any, logits_meta: Any) -> Any:
            model_ = nnx.merge(gdef, jax.tree_util.tree_unflatten(sdef, leaves))
            return model_(forward_batch, pools, logits_meta)

        fn = jax.jit(run, donate_argnums=(2,))  # sglang-jax donates memory_pools
        return fn.lower(leaves, forward_batch, MemoryPools(token_to_kv_pool=pool), logits_meta)


def _attention(name: str, model: ModelConfig, head_dim: int, mesh: Any) -> Any:
    """sglang-jax's attention backend ``name`` as its model runner builds it for Qwen3."""
    if name == "fa":
        from sgl_jax.srt.layers.attention.flashattention_backend import FlashAttention

        return FlashAttention(
            model.num_attention_heads, model.num_key_value_heads, head_dim, engine_layout.PAGE_SIZE, mesh=mesh
        )
    if name == "native":
        from sgl_jax.srt.layers.attention.native_backend import NativeAttention

        return NativeAttention(model.num_attention_heads, model.num_key_value_heads, mesh)
    raise ValueError(f"attention backend {name!r}: fa or native")


@contextlib.contextmanager
def _as_target(devices: list[Any]) -> Iterator[None]:
    """sglang-jax traced as if ``devices`` were the runtime's, its arrays abstract (restored on exit)."""
    import jax
    import numpy as np
    from sgl_jax.srt.layers import logits_processor as lp
    from sgl_jax.srt.layers.attention import flashattention_backend as fa
    from sgl_jax.srt.mem_cache import memory_pool as mp
    from sgl_jax.srt.model_executor import forward_batch_info as fbi
    from sgl_jax.srt.utils import jax_utils

    def abstract(data: Any, sharding: Any = None, **_: Any) -> Any:
        def one(a: Any) -> Any:
            a = np.asarray(a)
            return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)

        return jax.tree.map(one, data)

    def zeros(shape: Any, dtype: Any, sharding: Any) -> Any:
        return lambda: jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)

    real_devices = jax.devices

    def target_devices(backend: Any = None) -> list[Any]:
        return list(devices) if backend is None else real_devices(backend)

    saved = [
        (jax, "devices", target_devices),
        (jax_utils, "_IS_TPU_RUNTIME_CACHED", devices[0].platform == "tpu"),
        (mp, "_get_kv_zero_allocator", zeros),
        (fbi, "device_array", abstract),
        (lp, "device_array", abstract),
        (fa, "device_array", abstract),
    ]
    old = [(mod, name, getattr(mod, name)) for mod, name, _ in saved]
    try:
        for mod, name, value in saved:
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in old:
            setattr(mod, name, value)

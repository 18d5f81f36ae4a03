"""The sglang-jax engine's device memory by its own layout: weights and the KV cache pool.

Both from sglang-jax 0.1.0rc0 itself, nothing allocated: its ``Qwen3ForCausalLM`` built abstractly
on the engine's mesh, each weight sharded as its ``WeightMapping`` says; ``MHATokenToKVPool``'s
per-layer ``[(size + page_size * dp) / page_size, page_size, kv_heads * 2 / packing, packing,
head_dim]`` buffer (``head_dim`` padded to 128), one layer compiled to check the formula.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from mllm_rl.memplan.kv import kv_cell_bytes, kv_tokens, mem_fraction_for, pool_bytes
from mllm_rl.presets import ModelConfig

PAGE_SIZE = 1  # sglang-jax's default --page-size
DP = 1  # one data-parallel rank: the adapter starts the engine with dp_size 1
# SglangJaxEngine's defaults; on CPU (the host's memory, which other processes move; the run caps
# the pool with max_total_tokens anyway) a high fraction.
DEFAULT_MEM_FRACTION = {"cpu": 0.9, "tpu": 0.6, "gpu": 0.6}

# sglang-jax's 'fa' kernel (ragged paged attention) has block sizes for these TPUs only (it
# raises NotImplementedError for others); on GPU it does not lower at all.
FA_TPU_VERSIONS = (5, 6, 7)


def tpu_version(device_kind: str) -> int | None:
    """The TPU generation in a ``device_kind`` ("TPU v5 lite" -> 5, "TPU7x" -> 7), else None."""
    m = re.match(r"^TPU[^\d]*(\d+)", device_kind)
    return int(m.group(1)) if m else None


def attention_backend(platform: str, device_kind: str) -> str:
    """sglang-jax's attention backend here: ``fa`` on the TPUs its kernel supports, else ``native``."""
    if platform == "tpu" and tpu_version(device_kind) in FA_TPU_VERSIONS:
        return "fa"
    return "native"


@dataclasses.dataclass(frozen=True)
class EngineWeights:
    bytes_per_device: int  # the most any device holds (device 0: every engine device holds one shard)
    compiler_bytes: int  # the compiler's size of the same arrays on one device (tile padding)
    tensors: int
    largest_tensor_bytes: int  # per device, for the update's staging


@dataclasses.dataclass(frozen=True)
class KVPool:
    tokens: int  # max_total_tokens of the pool
    cell_bytes: int  # one token, all layers, one device
    pad_tokens: int  # page_size * dp extra slots sglang-jax allocates
    bytes_per_device: int
    mem_fraction_static: float  # the value that gives this pool from ``free_bytes``
    free_bytes: int  # memory free on a device when the engine starts
    rule: str  # how the size was chosen


def engine_dtype(model: ModelConfig) -> str:
    """The adapter starts sglang-jax in the checkpoint's dtype (KV cache dtype ``auto`` follows)."""
    return "float32" if model.torch_dtype == "float32" else "bfloat16"


def engine_mesh(devices: list[Any], tp: int) -> Any:
    """sglang-jax's mesh: ``("data", "tensor")`` = (1, tp), explicit axes, the first ``tp`` devices."""
    import jax
    import numpy as np

    axis = jax.sharding.AxisType.Explicit
    return jax.sharding.Mesh(
        np.array(devices[:tp]).reshape(1, tp), ("data", "tensor"), axis_types=(axis, axis)
    )


def _hf_config(model: ModelConfig) -> Any:
    from transformers import Qwen3Config

    skip = ("architectures", "model_type", "mllm_rl_preset")
    return Qwen3Config(**{k: v for k, v in model.to_hf_config().items() if k not in skip})


def weights(model: ModelConfig, devices: list[Any], tp: int) -> EngineWeights:
    """Per-device bytes of the engine's weights as sglang-jax's dummy loader places them: the model
    built abstractly on its mesh, every mapped weight with its mapping's sharding."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from sgl_jax.srt.models.qwen3 import Qwen3ForCausalLM

    from mllm_rl.backends.jax.engine_weights import dotted

    mesh = engine_mesh(devices, tp)
    dtype = jnp.dtype(engine_dtype(model))
    hf = _hf_config(model)
    with jax.set_mesh(mesh):
        abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(hf, mesh=mesh, dtype=dtype))
    flat = jax.tree_util.tree_flatten_with_path(nnx.split(abstract)[1])[0]
    by_path = {dotted(path): leaf for path, leaf in flat}
    specs = []
    for hf_name, m in abstract._create_qwen3_weight_mappings().items():
        target = m.target_path if isinstance(m.target_path, str) else None
        if target not in by_path:
            raise RuntimeError(f"sglang-jax mapping for {hf_name} names no model leaf ({m.target_path})")
        leaf = by_path[target]
        specs.append((leaf.shape, leaf.dtype, NamedSharding(mesh, P(*m.sharding) if m.sharding else P())))
    per = [int(np.prod(sh.shard_shape(shape))) * jnp.dtype(dt).itemsize for shape, dt, sh in specs]

    def alloc() -> list[Any]:
        return [jnp.zeros(shape, dt) for shape, dt, _ in specs]

    compiled = jax.jit(alloc, out_shardings=[sh for _, _, sh in specs]).lower().compile()
    return EngineWeights(sum(per), int(compiled.memory_analysis().output_size_in_bytes), len(specs), max(per))


def batch_bucket(n: int, max_running_requests: int) -> int:
    """The padded decode batch sglang-jax runs ``n`` requests in: the smallest of its buckets
    (powers of two up to 256 within ``max_running_requests``, then that) holding them."""
    buckets = [1 << i for i in range(9) if 1 << i <= max_running_requests]
    if not buckets or buckets[-1] < max_running_requests:
        buckets.append(max_running_requests)
    n = max(1, min(n, max_running_requests))
    return next(b for b in buckets if b >= n)


# sglang-jax's default prefill chunk (ServerArgs.chunked_prefill_size), left at the default
CHUNKED_PREFILL_TOKENS = 4096


def logits_bytes(model: ModelConfig, max_running_requests: int, batch: int) -> tuple[int, int]:
    """``(bytes, rows)`` of the float32 logits sglang-jax keeps between generate calls: one
    ``[max_running_requests, V]`` array and two ``[bucket, V]`` of the last decode batches (counted
    whole on every device: an upper bound)."""
    b = batch_bucket(batch, max_running_requests)
    rows = 2 * max_running_requests if b == max_running_requests else max_running_requests + 2 * b
    return rows * model.vocab_size * 4, rows


def kv_cell(model: ModelConfig, tp: int) -> int:
    """Bytes of one token's K and V, every layer, on one device (sglang-jax: head_dim -> x128)."""
    itemsize = 4 if engine_dtype(model) == "float32" else 2
    return kv_cell_bytes(
        model.num_hidden_layers, model.num_key_value_heads, model.head_dim, itemsize, tp, head_dim_align=128
    )


def size_pool(
    model: ModelConfig,
    tp: int,
    free_bytes: int,
    weight_bytes: int,
    platform: str,
    max_total_tokens: int | None,
    mem_fraction_static: float | None,
) -> KVPool:
    """The pool sglang-jax builds with ``free_bytes`` free per device: ``max_total_tokens`` and
    the ``mem_fraction_static`` it needs, else the pool ``mem_fraction_static`` gives. ValueError
    when the engine would not start."""
    cell = kv_cell(model, tp)
    if max_total_tokens is not None:
        tokens = max_total_tokens // PAGE_SIZE * PAGE_SIZE
        need = mem_fraction_for(weight_bytes, tokens * cell, free_bytes)  # sglang-jax counts no padding here
        frac = need if mem_fraction_static is None else mem_fraction_static
        fit = max(0, kv_tokens(int(frac * free_bytes - weight_bytes), cell))
        if mem_fraction_static is not None and fit < tokens:
            rule = (
                f"max_total_tokens {max_total_tokens}, but mem_fraction_static {frac} gives only "
                f"{fit} tokens (sglang-jax takes the smaller)"
            )
            tokens = fit // PAGE_SIZE * PAGE_SIZE
        else:
            rule = f"max_total_tokens {max_total_tokens}"
    else:
        frac = DEFAULT_MEM_FRACTION[platform] if mem_fraction_static is None else mem_fraction_static
        tokens = kv_tokens(int(frac * free_bytes - weight_bytes), cell) // PAGE_SIZE * PAGE_SIZE
        rule = f"mem_fraction_static {frac} of the {free_bytes} bytes free at engine start"
    if tokens < 1 or frac * free_bytes <= weight_bytes:
        raise ValueError(
            f"sglang-jax would not start: engine weights {weight_bytes} B per device leave no KV room in "
            f"mem_fraction_static {frac} x {free_bytes} B (it raises 'Not enough memory')"
        )
    return KVPool(
        tokens, cell, PAGE_SIZE * DP, pool_bytes(tokens, cell, PAGE_SIZE * DP), frac, free_bytes, rule
    )


def compile_layer(model: ModelConfig, devices: list[Any], tp: int, tokens: int) -> int:
    """The compiler's per-device size of one layer's fused KV buffer (sglang-jax's allocator)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = engine_mesh(devices, tp)
    dtype = jnp.dtype(engine_dtype(model))
    packing = max(1, 4 // dtype.itemsize)
    head_dim = -(-model.head_dim // 128) * 128
    heads = max(model.num_key_value_heads, tp)
    shape = ((tokens + PAGE_SIZE * DP) // PAGE_SIZE, PAGE_SIZE, heads * 2 // packing, packing, head_dim)
    sharding = NamedSharding(mesh, P("data", None, "tensor", None, None))
    fn = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return int(fn.lower().compile().memory_analysis().output_size_in_bytes)

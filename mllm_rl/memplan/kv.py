"""KV pool sizing by the engines' own rules (exact layout formulas, no compiler needed).

sglang-jax (``model_runner_kv_cache_mixin.py``, 0.1.0rc0): one token's cell holds K and V of
every layer for the kv heads of one tensor-parallel shard, head_dim padded to a multiple of
128; the pool gets ``mem_fraction_static`` of the device memory free when the engine starts.
SGLang (``model_runner.py`` / ``memory_pool.py``): the same cell without the head_dim padding;
the backend that sizes a pool says which rule it follows.
"""

from __future__ import annotations

import math


def kv_cell_bytes(
    num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1, head_dim_align: int = 1
) -> int:
    """Bytes of one token's K+V in one tensor-parallel shard (all layers).

    kv heads are split over ``tp`` (at least one head per shard: a tp larger than the kv
    heads replicates them, as both engines do).
    """
    heads = max(1, math.ceil(kv_heads / tp))
    d = -(-head_dim // head_dim_align) * head_dim_align
    return heads * d * 2 * num_layers * dtype_bytes


def kv_tokens(pool_size: int, cell_bytes: int) -> int:
    """Tokens a pool of ``pool_size`` bytes per device holds (without the padding slots)."""
    return pool_size // cell_bytes if cell_bytes > 0 else 0


def pool_bytes(tokens: int, cell_bytes: int, pad_tokens: int = 0) -> int:
    """Bytes per device of a pool of ``tokens`` (sglang-jax allocates ``pad_tokens`` more slots:
    ``page_size * dp``)."""
    return (tokens + pad_tokens) * cell_bytes


def max_pool_tokens(room_bytes: int, cell_bytes: int, pad_tokens: int = 0) -> int:
    """The most tokens a pool can hold within ``room_bytes`` per device (may be <= 0)."""
    return room_bytes // cell_bytes - pad_tokens if cell_bytes > 0 else 0


def mem_fraction_for(weight_bytes: int, pool_size: int, free_bytes: int) -> float:
    """The ``mem_fraction_static`` (rounded up to 0.001) that makes sglang-jax build a pool of
    ``pool_size`` bytes next to ``weight_bytes`` of weights, with ``free_bytes`` free per device
    when it starts: its rule gives the pool ``fraction * free - weights``."""
    return math.ceil((weight_bytes + pool_size) / free_bytes * 1000) / 1000

"""KV pool sizing by the engines' own layout rules: a token's cell holds K and V of every layer for
one tensor-parallel shard's kv heads (sglang-jax pads head_dim to 128, SGLang does not); sglang-jax
gives the pool ``mem_fraction_static`` of the memory free when the engine starts."""

from __future__ import annotations

import math


def kv_cell_bytes(
    num_layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, tp: int = 1, head_dim_align: int = 1
) -> int:
    """Bytes of one token's K+V in one tensor-parallel shard, all layers (at least one kv head per
    shard: a larger tp replicates them, as both engines do)."""
    heads = max(1, math.ceil(kv_heads / tp))
    d = -(-head_dim // head_dim_align) * head_dim_align
    return heads * d * 2 * num_layers * dtype_bytes


def pool_requests(prompts: int, group_size: int, max_running_requests: int, eval_prompts: int = 0) -> int:
    """Requests one generate of an RL run holds at once: a rollout's prompts x samples, or the
    held-out prompts of an evaluation, at most ``max_running_requests``; an unset pool is this many
    requests x context (the run's rule, ``mllm_rl.plans.rl.size_engine``)."""
    return min(max_running_requests, max(prompts * group_size, eval_prompts))


def kv_tokens(pool_size: int, cell_bytes: int) -> int:
    """Tokens a pool of ``pool_size`` bytes per device holds (without the padding slots)."""
    return pool_size // cell_bytes if cell_bytes > 0 else 0


def pool_bytes(tokens: int, cell_bytes: int, pad_tokens: int = 0) -> int:
    """Bytes per device of a pool of ``tokens`` (sglang-jax adds ``pad_tokens``: ``page_size * dp``)."""
    return (tokens + pad_tokens) * cell_bytes


def max_pool_tokens(room_bytes: int, cell_bytes: int, pad_tokens: int = 0) -> int:
    """The most tokens a pool can hold within ``room_bytes`` per device (may be <= 0)."""
    return room_bytes // cell_bytes - pad_tokens if cell_bytes > 0 else 0


def mem_fraction_for(weight_bytes: int, pool_size: int, free_bytes: int) -> float:
    """The ``mem_fraction_static`` (rounded up to 0.001) for which sglang-jax's rule, pool =
    ``fraction * free - weights``, builds a pool of ``pool_size`` bytes."""
    return math.ceil((weight_bytes + pool_size) / free_bytes * 1000) / 1000

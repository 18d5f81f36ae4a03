"""A shape-based estimate of what an engine's forward step adds on the device while it generates
(the ``engine_step`` function), where it is not compiled: a CPU target, ``--engine-forward
estimate``, or a forward that did not compile for the target (``backends/jax/engine_compile.py``).

Labelled ``estimate``. Per device, for one forward of ``tokens`` tokens (the larger of a prefill
chunk and a decode batch) in the compute dtype: one decoder layer's activations (no backward;
heads and intermediate split over ``tp``) plus the sampler's three float32 ``[rows, vocab]``
arrays. Left out: attention kernel scratch (ragged paged attention works page by page), fusion
temporaries, and the kept logits (the ``engine_logits`` component)."""

from __future__ import annotations

from mllm_rl.presets import ModelConfig

SAMPLER_ARRAYS = 3  # float32 [rows, vocab]: logits, softmax, a sorted copy for top-k / top-p


def forward_bytes(model: ModelConfig, tp: int, tokens: int, rows: int, itemsize: int = 2) -> tuple[int, str]:
    """``(bytes per device, detail)`` of one engine forward step (module docstring).

    ``tokens``: tokens in the forward; ``rows``: sequences sampled from at once; ``itemsize``:
    bytes of the compute dtype."""
    c = model
    h, d = c.hidden_size, c.head_dim
    q = c.num_attention_heads // tp * d
    kv = c.num_key_value_heads // tp * d
    mlp = -(-c.intermediate_size // tp)
    per_token = (
        4 * h + 2 * q + 2 * kv + 3 * mlp
    )  # residual, normed, o-out, down-out; q, attn; k, v; gate, up, act
    layer = tokens * per_token * itemsize
    sampler = SAMPLER_ARRAYS * rows * c.vocab_size * 4
    detail = (
        f"estimate from the shapes: one layer's activations for {tokens} tokens ({layer} B) + "
        f"{SAMPLER_ARRAYS} float32 [{rows}, {c.vocab_size}] sampler arrays ({sampler} B); not compiled"
    )
    return layer + sampler, detail

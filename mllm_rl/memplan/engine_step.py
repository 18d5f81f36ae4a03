"""An estimate from the shapes of what an engine's forward step adds on the device (the
``engine_step`` function) where it is not compiled: one decoder layer's activations (split over
``tp``) plus the sampler's float32 ``[rows, vocab]`` arrays; attention scratch and fusion
temporaries left out."""

from __future__ import annotations

from mllm_rl.presets import ModelConfig

SAMPLER_ARRAYS = 3  # float32 [rows, vocab]: logits, softmax, a sorted copy for top-k / top-p


def forward_bytes(model: ModelConfig, tp: int, tokens: int, rows: int, itemsize: int = 2) -> tuple[int, str]:
    """``(bytes per device, detail)`` of a forward of ``tokens`` tokens sampling ``rows`` sequences."""
    c = model
    h, d = c.hidden_size, c.head_dim
    q = c.num_attention_heads // tp * d
    kv = c.num_key_value_heads // tp * d
    mlp = -(-c.intermediate_size // tp)
    # residual, normed, o-out, down-out; q, attn; k, v; gate, up, act
    per_token = 4 * h + 2 * q + 2 * kv + 3 * mlp
    layer = tokens * per_token * itemsize
    sampler = SAMPLER_ARRAYS * rows * c.vocab_size * 4
    detail = (
        f"estimate from the shapes: one layer's activations for {tokens} tokens ({layer} B) + "
        f"{SAMPLER_ARRAYS} float32 [{rows}, {c.vocab_size}] sampler arrays ({sampler} B); not compiled"
    )
    return layer + sampler, detail

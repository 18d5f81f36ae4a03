"""An estimate, from the shapes, of what an engine's forward step adds to the device while it
generates (the ``engine_step`` function of the rollout phases), where the engine's step cannot be
compiled from shapes alone (sglang-jax builds its batch metadata on the host, in its scheduler).

Labelled ``estimate`` (``FunctionMemory.method``), not a compiler figure. What it counts, per
device, for one forward of ``tokens`` tokens (a prefill chunk: at most the engine's
``chunked_prefill_size`` and at most the rollout's sequences x their length; or a decode batch,
whichever is larger) in the compute dtype:

- one decoder layer's activations alive at once (the forward runs layer by layer and keeps
  nothing for a backward): the residual stream and its normed copy, the q / k / v projections
  and the attention output (heads split over ``tp``), the o-projection's output, the MLP's gate,
  up and activated products (intermediate split over ``tp``) and its down-projection output;
- the sampler's float32 ``[rows, vocab]`` arrays: the logits, their softmax and one sorted copy
  (top-k / top-p), ``rows`` = the sequences decoded at once (at most ``max_running_requests``).

What it leaves out: the attention kernel's own scratch (ragged paged attention works page by
page), the compiler's fusion temporaries, and the logits the engine keeps between calls (the
``engine_logits`` component has those). Pure arithmetic: imports nothing heavy.
"""

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

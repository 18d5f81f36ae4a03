"""Parity (a): our torch Qwen3 vs Hugging Face ``transformers`` Qwen3ForCausalLM on the same checkpoint.

Tolerance: logits within 1e-4 absolute (fp32; logits are ~N(0, 1), seen: ~2e-6), identical
greedy tokens, logprobs within 1e-4.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mllm_rl.backends.torch.model import KVCache, greedy_decode, load_qwen3
from mllm_rl.checkpoint import ModelDir, make_checkpoint
from mllm_rl.presets import get_preset

ATOL = 1e-4
TOKENS = torch.tensor([[51, 71, 68, 220, 66, 64, 79, 72], [0, 0, 0, 160, 121, 254, 162, 3]])
MASK = torch.tensor([[1] * 8, [0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.bool)  # row 1 left-padded


@pytest.fixture(scope="module")
def ours(tiny_ckpt):
    return load_qwen3(ModelDir.open(tiny_ckpt))


def hf_logits_batch(hf, tokens, mask):
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        return hf(input_ids=tokens, attention_mask=mask.long(), position_ids=positions).logits.float()


def test_parameter_names_are_the_hf_names(ours, tiny_ckpt, hf_model):
    names = [n for n, _ in ours.named_parameters()]
    assert names == list(get_preset("tiny").param_shapes())
    assert set(names) == set(ModelDir.open(tiny_ckpt).tensors) == {n for n, _ in hf_model.named_parameters()}
    assert tuple(dict(ours.named_parameters())["model.layers.0.self_attn.q_proj.weight"].shape) == (512, 128)


def test_logits_match_hf_with_left_padding(ours, hf_model):
    with torch.no_grad():
        got = ours(TOKENS, MASK)
    want = hf_logits_batch(hf_model, TOKENS, MASK)
    assert got.dtype == torch.float32 and got.shape == (2, 8, 384)
    assert (got[0] - want[0]).abs().max() < ATOL
    assert (got[1, 3:] - want[1, 3:]).abs().max() < ATOL  # real positions of the padded row
    with torch.no_grad():  # left padding does not change a row's real logits
        alone = ours(TOKENS[1:, 3:])
    assert (got[1, 3:] - alone[0]).abs().max() < ATOL


def test_greedy_tokens_match_hf(ours, hf_logits):
    from tests.engine_contract import reference_greedy

    for prompt in ([51, 71, 68, 220, 66, 64, 79], [160, 121, 254, 162]):
        toks, lps = greedy_decode(ours, prompt, 12)
        ref_toks, ref_lps = reference_greedy(hf_logits, prompt, 12, eos=256)
        assert toks == ref_toks
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < ATOL


def test_cached_path_equals_training_forward(ours):
    """Prefill + decode through an external KV cache gives the full forward's logits."""
    c = ours.config
    b, t, cap = 2, 8, 12
    pool = torch.zeros(c.num_hidden_layers, 2, b, cap, c.num_key_value_heads, c.head_dim)
    cache = KVCache(
        [pool[i, 0] for i in range(c.num_hidden_layers)], [pool[i, 1] for i in range(c.num_hidden_layers)]
    )
    key_mask = torch.zeros(b, cap, dtype=torch.bool)
    key_mask[:, :t] = MASK
    positions = (MASK.long().cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        full = ours(TOKENS, MASK)
        pre = ours.forward_cached(TOKENS[:, :6], positions[:, :6], key_mask, cache, 0)
        steps = [
            ours.forward_cached(TOKENS[:, i : i + 1], positions[:, i : i + 1], key_mask, cache, i)
            for i in (6, 7)
        ]
    assert (pre - full[:, :6])[MASK[:, :6]].abs().max() < ATOL
    for i, s in zip((6, 7), steps, strict=True):
        assert (s[:, 0] - full[:, i]).abs().max() < ATOL


def test_forward_is_differentiable(ours):
    ours.zero_grad()
    ours(TOKENS, MASK).log_softmax(-1)[MASK].mean().backward()
    for name, p in ours.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert any(p.grad.abs().sum() > 0 for p in ours.parameters())
    ours.zero_grad(set_to_none=True)


def test_tied_embeddings_match_hf(tmp_path):
    from transformers import Qwen3ForCausalLM

    cfg = dataclasses.replace(get_preset("tiny"), name="tiny-tied", tie_word_embeddings=True)
    ckpt = make_checkpoint(cfg, tmp_path / "tied", show_progress=False)
    ours = load_qwen3(ModelDir.open(ckpt))
    assert "lm_head.weight" not in dict(ours.named_parameters())
    hf = Qwen3ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (ours(TOKENS, MASK)[0] - hf_logits_batch(hf, TOKENS, MASK)[0]).abs().max() < ATOL


def test_bf16_checkpoint_loads_as_bf16(tmp_path, tiny_ckpt):
    ckpt = make_checkpoint(get_preset("tiny"), tmp_path / "bf16", dtype="bfloat16", show_progress=False)
    m16, m32 = load_qwen3(ModelDir.open(ckpt)), load_qwen3(ModelDir.open(tiny_ckpt))
    assert all(p.dtype == torch.bfloat16 for p in m16.parameters())
    w16 = dict(m16.named_parameters())["model.embed_tokens.weight"].float()
    w32 = dict(m32.named_parameters())["model.embed_tokens.weight"]
    assert (w16 - w32).abs().max() <= 2**-8 * w32.abs().max()  # the bf16 rounding of the same values
    with torch.no_grad():
        assert m16(TOKENS, MASK).dtype == torch.float32

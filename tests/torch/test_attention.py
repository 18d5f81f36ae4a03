"""SDPA attention and the chunked log-prob head (backends/torch/model.py) against the eager paths
they replaced: outputs and gradients on random weights, float32 and bf16, with left and right
padding; what the chunked head keeps for the backward; the planner's activations linear in T."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.func import functional_call

from mllm_rl.backends.torch import memplan
from mllm_rl.backends.torch.model import (
    KVCache,
    attend,
    attend_masked_gqa,
    attention_bias,
    build_qwen3,
    rope,
    rope_tables,
    token_logprobs,
)
from mllm_rl.backends.torch.trainer import TorchTrainer, right_padded
from mllm_rl.presets import get_preset
from mllm_rl.trainer import RolloutBatch, TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")

# tiny, with 3 layers and GQA 4:2 (the preset's heads), a vocabulary the head's chunks do not divide
CFG = dataclasses.replace(get_preset("tiny"), num_hidden_layers=3, vocab_size=200)
B, T = 3, 24
# row 0: no padding; row 1: left padding (the engine's prompts); row 2: right padding (the trainer's)
MASK = torch.ones(B, T, dtype=torch.bool)
MASK[1, :5] = False
MASK[2, 17:] = False
# float32: eager and SDPA differ by rounding only (seen ~1e-6 on logits ~N(0, 1))
# bf16: SDPA's kernel keeps its scores in float32, the eager path rounds them to bf16 (seen ~0.03)
TOL = {torch.float32: 1e-4, torch.bfloat16: 0.15}


def model(dtype: torch.dtype, attention: str = "sdpa", seed: int = 0):
    torch.manual_seed(seed)
    m = build_qwen3(CFG, torch.float32, "cpu", attention)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return m.to(dtype)


def tokens(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (B, T), generator=g)


def logits(m, toks, mask, attention: str) -> torch.Tensor:
    m.attention = attention
    return m(toks, mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_equals_eager_with_left_and_right_padding(dtype):
    m, toks = model(dtype), tokens()
    with torch.no_grad():
        eager, sdpa = logits(m, toks, MASK, "eager"), logits(m, toks, MASK, "sdpa")
        unmasked = logits(m, toks, None, "sdpa")  # what a dropped mask would give
    assert sdpa.dtype == torch.float32 and sdpa.shape == (B, T, CFG.vocab_size)
    assert torch.isfinite(sdpa).all()  # padding queries attend to themselves: no NaN row
    err = (sdpa - eager).abs()[MASK].max().item()
    assert err < TOL[dtype], err
    # the tolerance tells a wrong mask apart: left padding seen as tokens moves row 1's logits
    assert (unmasked[1] - eager[1])[MASK[1]].abs().max() > 10 * TOL[dtype]
    # right padding needs no mask: its slots come after every real query
    assert (unmasked[2] - sdpa[2])[MASK[2]].abs().max() < TOL[dtype]


def test_attention_bias_allows_causal_real_keys_and_the_own_slot():
    bias = attention_bias(MASK, torch.arange(T), torch.bfloat16)
    assert bias.shape == (B, 1, T, T) and bias.dtype == torch.bfloat16
    allowed = bias[:, 0] == 0
    assert ((bias[:, 0] == 0) | (bias[:, 0] == float("-inf"))).all()
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    want = causal & MASK[:, None, :] | torch.eye(T, dtype=torch.bool)  # a padding query sees itself only
    assert torch.equal(allowed, want)
    assert allowed.any(-1).all()  # no fully masked row (a kernel may return NaN for one)
    # decode: one query at slot 20 of 24 cache slots
    one = attention_bias(MASK, torch.tensor([20]), torch.float32)[:, 0, 0]
    assert torch.equal(one == 0, MASK & (torch.arange(T) <= 20) | (torch.arange(T) == 20))


def test_sdpa_gradients_equal_eager_fp32():
    toks = tokens()
    grads = {}
    for attention in ("eager", "sdpa"):
        m = model(torch.float32, attention)
        lp = m(toks, MASK, targets=torch.roll(toks, -1, 1))
        (lp * MASK).sum().backward()
        grads[attention] = {n: p.grad for n, p in m.named_parameters()}
    for n, g in grads["eager"].items():
        assert torch.allclose(grads["sdpa"][n], g, atol=1e-5, rtol=1e-4), n
    assert grads["sdpa"]["model.layers.0.self_attn.q_proj.weight"].abs().max() > 1e-3  # a real gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cached_prefill_and_decode_equal_eager(dtype):
    """The engine's path: a left-padded prefill then one-token decodes over an external KV cache."""
    m, toks = model(dtype), tokens()
    cap, pre = T, 16
    positions = (MASK.long().cumsum(1) - 1).clamp(min=0)
    out = {}
    for attention in ("eager", "sdpa"):
        m.attention = attention
        pool = torch.zeros(
            CFG.num_hidden_layers, 2, B, cap, CFG.num_key_value_heads, CFG.head_dim, dtype=dtype
        )
        cache = KVCache([p[0] for p in pool], [p[1] for p in pool])
        key_mask = torch.zeros(B, cap, dtype=torch.bool)
        key_mask[1, 5:pre] = key_mask[0, :pre] = key_mask[2, :pre] = True
        with torch.no_grad():
            steps = [m.forward_cached(toks[:, :pre], positions[:, :pre], key_mask, cache, 0)]
            for i in range(pre, T):
                key_mask[:, i] = True
                steps.append(
                    m.forward_cached(toks[:, i : i + 1], positions[:, i : i + 1], key_mask, cache, i)
                )
        out[attention] = torch.cat(steps, 1)
    assert torch.isfinite(out["sdpa"]).all()
    real = MASK.clone()
    real[2] = True  # the cache path has no right padding: row 2's tokens are all real here
    err = (out["sdpa"] - out["eager"]).abs()[real].max().item()
    assert err < TOL[dtype], err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t", [1, 5])
def test_the_cuda_masked_gqa_path_equals_sdpa_with_enable_gqa(dtype, t):
    """``attend_masked_gqa`` (what ``attend`` runs on CUDA for a bias mask and K < N heads: SDPA has
    no fused kernel for GQA with a mask) on CPU against SDPA's own ``enable_gqa``: query head h
    reads kv head h // (N/K). A decode step folds the query groups into the query axis, a longer T
    repeats k, v; a kv head order reversed moves the result far outside the tolerance."""
    g = torch.Generator().manual_seed(3)
    b, s, n, kh, d = 3, 19, 8, 2, 16
    q, k, v = (torch.randn(b, r, h, d, generator=g).to(dtype) for r, h in ((t, n), (s, kh), (s, kh)))
    key_mask = torch.rand(b, s, generator=g) > 0.3
    bias = attention_bias(key_mask, torch.arange(s - t, s), dtype)  # [B, 1, T, S]
    want = attend(q, k, v, bias)  # CPU: SDPA with enable_gqa
    got = attend_masked_gqa(q, k, v, bias)
    assert got.shape == want.shape == (b, t, n * d)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL[dtype] / 10)
    crossed = attend_masked_gqa(q, k.flip(2), v.flip(2), bias)
    assert (crossed.float() - want.float()).abs().max() > TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_on_cuda_the_masked_gqa_path_runs_the_memory_efficient_kernel(dtype):
    """Why ``attend`` leaves ``enable_gqa`` for a bias mask on CUDA: with only the memory-efficient
    kernel allowed, ``attend_masked_gqa`` runs (decode and prefill shapes) and SDPA with
    ``enable_gqa`` and the mask finds no kernel (it would fall back to math)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tests.torch.conftest import needs_cuda

    needs_cuda()
    b, s, n, kh, d = 2, 40, 16, 8, 128
    for t in (1, 7):
        q = torch.randn(b, t, n, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, s, kh, d, device="cuda", dtype=dtype) for _ in range(2))
        bias = attention_bias(torch.ones(b, s, dtype=torch.bool, device="cuda"), torch.arange(s - t, s, device="cuda"), dtype)  # fmt: skip
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            out = attend_masked_gqa(q, k, v, bias)
            with pytest.raises(RuntimeError):
                torch.nn.functional.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias, enable_gqa=True
                )
        torch.testing.assert_close(
            out, attend(q.cpu(), k.cpu(), v.cpu(), bias.cpu()).cuda(), rtol=0, atol=TOL[dtype]
        )


def test_rope_tables_rotate_pairs_exactly_as_the_pairwise_formula():
    """``rope(x, rope_tables(...))`` is bit-for-bit [x1 cos - x2 sin, x2 cos + x1 sin] in float32."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 5, 3, 16, generator=g).to(torch.bfloat16)
    pos = torch.randint(0, 4000, (2, 5), generator=g)
    inv = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    ang = pos[..., None].float() * inv
    cos, sin = torch.cos(ang)[:, :, None], torch.sin(ang)[:, :, None]
    x1, x2 = x.float()[..., :8], x.float()[..., 8:]
    want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(torch.bfloat16)
    assert torch.equal(rope(x, rope_tables(pos, 16, 1e6)), want)


# -- the chunked head -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_prefill_runs_the_head_on_its_last_position_only(dtype, monkeypatch):
    """``forward_cached(..., last_only=True)``, what the embedded engine's prefill calls: the head
    sees [B, 1, H] (not the whole prompt batch, whose float32 [B, T, V] logits are 37 GiB for
    64 prompts of 1024 tokens of Qwen3-4B), and its logits are the full prefill's last column."""
    m, toks = model(dtype), tokens()
    pre = 16
    positions = (MASK.long().cumsum(1) - 1).clamp(min=0)[:, :pre]
    key_mask = torch.zeros(B, T, dtype=torch.bool)
    key_mask[1, 5:pre] = key_mask[0, :pre] = key_mask[2, :pre] = True

    def fresh_cache() -> KVCache:
        pool = torch.zeros(CFG.num_hidden_layers, 2, B, T, CFG.num_key_value_heads, CFG.head_dim, dtype=dtype)
        return KVCache([p[0] for p in pool], [p[1] for p in pool])

    with torch.no_grad():
        full = m.forward_cached(toks[:, :pre], positions, key_mask, fresh_cache(), 0)
        seen = []
        head = m.logits
        monkeypatch.setattr(m, "logits", lambda x: seen.append(tuple(x.shape)) or head(x))
        last = m.forward_cached(toks[:, :pre], positions, key_mask, fresh_cache(), 0, last_only=True)
    assert seen == [(B, 1, CFG.hidden_size)] and last.shape == (B, 1, CFG.vocab_size)
    torch.testing.assert_close(last[:, 0], full[:, -1], rtol=0, atol=TOL[dtype])


def reference_logp(x, targets, norm_w, eps, head, temperature):
    """Today's head: the whole float32 [B, T, V], then log_softmax(logits / T) at the targets."""
    x32 = x.float()
    h = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * norm_w.float()).to(x.dtype)
    lg = (h @ head.T).float() / temperature
    return lg.gather(-1, targets[..., None])[..., 0] - torch.logsumexp(lg, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [7, 16, 1024])
def test_chunked_logprobs_and_gradients_equal_the_whole_head(dtype, chunk):
    g = torch.Generator().manual_seed(0)
    h, v = 32, 200
    x = torch.randn(B, T, h, generator=g).to(dtype).requires_grad_()
    norm_w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype).requires_grad_()
    head = (0.2 * torch.randn(v, h, generator=g)).to(dtype).requires_grad_()
    tgt = torch.randint(0, v, (B, T), generator=g)
    w = torch.randn(B, T, generator=g)  # a loss that weighs every position differently
    got = token_logprobs(x, tgt, norm_w, 1e-6, head, temperature=0.7, chunk=chunk)
    grads = torch.autograd.grad((got * w).sum(), (x, norm_w, head))
    want = reference_logp(x, tgt, norm_w, 1e-6, head, 0.7)
    want_grads = torch.autograd.grad((want * w).sum(), (x, norm_w, head))
    assert got.dtype == torch.float32 and got.shape == (B, T)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, want, atol=tol), (got - want).abs().max()
    for a, b in zip(grads, want_grads, strict=True):
        assert torch.allclose(a.float(), b.float(), atol=tol * 10, rtol=tol), (
            (a.float() - b.float()).abs().max()
        )
    # the temperature is applied: untempered log-probs are elsewhere
    assert (token_logprobs(x, tgt, norm_w, 1e-6, head, 1.0, chunk) - got).abs().max() > 0.1


def test_chunked_logprobs_with_frozen_weights():
    """LoRA: the head and the final norm are frozen; only the hidden states get a gradient."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, T, 32, generator=g).requires_grad_()
    norm_w, head = torch.ones(32), 0.2 * torch.randn(200, 32, generator=g)
    tgt = torch.randint(0, 200, (B, T), generator=g)
    (gx,) = torch.autograd.grad(token_logprobs(x, tgt, norm_w, 1e-6, head, 0.7, chunk=16).sum(), (x,))
    (want,) = torch.autograd.grad(reference_logp(x, tgt, norm_w, 1e-6, head, 0.7).sum(), (x,))
    assert torch.allclose(gx, want, atol=1e-5)


def saved_bytes(fn) -> int:
    """Bytes of the tensors autograd saves for the backward while ``fn`` runs (float32 ones)."""
    total = 0

    def pack(t):
        nonlocal total
        if t.dtype == torch.float32:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_chunked_head_keeps_no_float32_logits_for_the_backward():
    g = torch.Generator().manual_seed(0)
    b, t, h, v, chunk = 2, 64, 16, 4096, 32
    x = torch.randn(b, t, h, generator=g, dtype=torch.bfloat16).requires_grad_()
    norm_w = torch.ones(h, dtype=torch.bfloat16, requires_grad=True)
    head = (0.2 * torch.randn(v, h, generator=g)).to(torch.bfloat16).requires_grad_()
    tgt = torch.randint(0, v, (b, t), generator=g)
    whole = saved_bytes(lambda: token_logprobs(x, tgt, norm_w, 1e-6, head, 0.7, chunk=None))
    chunked = saved_bytes(lambda: token_logprobs(x, tgt, norm_w, 1e-6, head, 0.7, chunk=chunk))
    logits_f32 = b * t * v * 4
    assert whole >= logits_f32  # the reference keeps (at least) every float32 logit
    assert chunked < chunk * v * 4  # less than one chunk's float32 logits: none is kept
    # the backward recomputes a chunk at a time and still gives the reference's gradient
    lp = token_logprobs(x, tgt, norm_w, 1e-6, head, 0.7, chunk=chunk)
    (gx,) = torch.autograd.grad(lp.sum(), (x,))
    (wx,) = torch.autograd.grad(reference_logp(x, tgt, norm_w, 1e-6, head, 0.7).sum(), (x,))
    assert torch.allclose(gx.float(), wx.float(), atol=2e-2)


def test_chunk_recompute_uses_the_swapped_compute_params():
    """Mixed precision swaps bf16 casts of float32 masters in with ``functional_call``; the head's
    checkpoint recomputes in the backward, after the swap is undone: the gradient must still reach
    the masters through the casts, equal to the unchunked head's."""
    m = model(torch.float32)
    toks = tokens()
    grads = {}
    for chunk in (None, 16):
        m.logprob_chunk = chunk
        m.zero_grad(set_to_none=True)
        casts = {n: p.to(torch.bfloat16) for n, p in m.named_parameters()}
        lp = functional_call(m, casts, (toks, None), {"targets": torch.roll(toks, -1, 1), "temperature": 0.7})
        lp.sum().backward()
        grads[chunk] = {n: p.grad.clone() for n, p in m.named_parameters()}
    eps = torch.finfo(torch.bfloat16).eps
    for n, g in grads[None].items():
        assert g.dtype == torch.float32 and g.abs().max() > 0, n
        # every parameter before the head gets the same gradient bit for bit; the head's (and the
        # final norm's) sums 5 chunks' bf16 gradients in float32, rounded once: within 2 bf16 ulps
        # of its largest entry (seen: 1)
        tol = 0.0 if n not in ("lm_head.weight", "model.norm.weight") else 2 * eps * g.abs().max().item()
        assert (grads[16][n] - g).abs().max() <= tol, (n, (grads[16][n] - g).abs().max())


# -- the trainer ----------------------------------------------------------------------------------
def test_right_padded():
    assert right_padded(np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], bool))
    assert not right_padded(np.array([[1, 1, 0], [0, 1, 1]], bool))  # left padding
    assert not right_padded(np.array([[1, 0, 1]], bool))  # a hole


def test_trainer_logprobs_of_a_left_padded_row_equal_the_unpadded_row(tiny_ckpt):
    """A batch with left padding takes the masked path, a right-padded one the causal one: the
    same row's log-probs agree (float32)."""
    from mllm_rl.checkpoint import ModelDir

    t = TorchTrainer(ModelDir.open(tiny_ckpt), TrainConfig(temperature=0.7))
    g = np.random.default_rng(0)
    row = g.integers(0, 256, 12).astype(np.int32)

    def batch(tok, mask):
        loss = mask.copy()
        loss[:, 0] = False
        z = np.zeros(tok.shape, np.float32)
        return RolloutBatch(tok, mask, loss & mask, z, np.ones(len(tok), np.float32))

    right = np.zeros((2, 16), np.int32)
    right[:, :12] = row
    rmask = np.zeros((2, 16), bool)
    rmask[:, :12] = True
    left = np.zeros((2, 16), np.int32)
    left[0, :12], left[1, 4:] = row, row
    lmask = np.zeros((2, 16), bool)
    lmask[0, :12] = lmask[1, 4:] = True
    assert right_padded(rmask) and not right_padded(lmask)
    lp_r = t.logprobs(batch(right, rmask))
    lp_l = t.logprobs(batch(left, lmask))
    np.testing.assert_allclose(
        lp_l[1, 5:], lp_r[0, 1:12], atol=2e-5
    )  # position 4 starts the row: no log-prob
    np.testing.assert_allclose(lp_l[0], lp_r[0], atol=2e-5)
    assert np.abs(lp_r[0, 1:12]).min() > 0


# -- the planner ----------------------------------------------------------------------------------
def test_planned_activations_grow_linearly_with_the_sequence():
    """SDPA and the chunked head keep O(T) for the backward: the activations at T, 2T, 4T tokens
    step by equal amounts per token (the eager path's [B, N, T, T] scores would make it T^2)."""
    tiny = get_preset("tiny")
    acts = [memplan.trainer_step_memory(tiny, 1, t, rows=1, dtype="float32", steps=1).activations
            for t in (1024, 2048, 4096)]  # fmt: skip
    assert acts[0] < acts[1] < acts[2]
    # equal to a few % (the peak's moment moves a little between sizes; seen 1.5%)
    assert acts[2] - acts[1] == pytest.approx(2 * (acts[1] - acts[0]), rel=0.05)
    eager = memplan.trainer_step_memory(tiny, 1, 4096, rows=1, dtype="float32", steps=1, attention="eager")
    n = tiny.num_attention_heads
    assert eager.activations - acts[2] >= tiny.num_hidden_layers * n * 4096**2 * 4  # one fp32 score per layer


# -- the benchmark ------------------------------------------------------------------------------
@pytest.mark.slow  # four paths, a fresh process each
def test_bench_torch_attention_runs_every_path_on_tiny(tmp_path):
    """``python -m mllm_rl.bench torch-attention`` end to end on a one-layer tiny model, all four paths in
    one run: every path measured, ratios over ``--baseline sdpa+chunked`` (the trainer's path), the JSON
    summary last; the eager path plans more activations than SDPA, the remat path fewer than the baseline."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    saved = tmp_path / "out.json"
    paths = {"eager", "sdpa", "sdpa+chunked", "sdpa+chunked+remat"}
    r = subprocess.run([sys.executable, "-m", "mllm_rl.bench", "torch-attention", "--preset", "tiny",
                        "--layers", "1", "--seq", "256", "--steps", "1", "--paths", ",".join(sorted(paths)),
                        "--baseline", "sdpa+chunked", "--json", str(saved)], capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    ratios = out["ratios_over_sdpa+chunked"]
    assert out["figure"] == "CPU" and set(ratios) == paths
    assert "CPU figure" in r.stdout and "x sdpa+chunked" in r.stdout
    assert set(ratios["sdpa+chunked+remat"]) == {"step_s", "rss_peak_rise", "planned_activations"}
    assert ratios["sdpa+chunked+remat"]["planned_activations"] < 1 < ratios["eager"]["planned_activations"]
    full = json.loads(saved.read_text())
    assert set(full["paths"]) == paths
    planned = {p: v["planned"]["activations_bytes"] for p, v in full["paths"].items()}
    assert planned["eager"] > planned["sdpa"] > 0
    assert 0 < planned["sdpa+chunked+remat"] < planned["sdpa+chunked"]
    assert all(v["step_s"] > 0 and v["rss_peak_rise_bytes"] >= 0 for v in full["paths"].values())

"""Qwen3 causal LM in torch (the embedded engine's and the trainer's): the math of
``backends/jax/model.py``, ``named_parameters()`` the Hugging Face names. Shapes: B batch, T new
positions, S key positions, H hidden, N heads, K kv heads, D head_dim, V vocab.

Attention ``"sdpa"``: ``is_causal`` without padding, else an additive bias [B, 1, T, S] (a padding
query attends to itself: no NaN); ``"eager"`` (float32 scores) is the parity reference.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from mllm_rl.backends.torch.cpu_half import linear
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.presets import ModelConfig
from mllm_rl.trainer import greedy_loop

TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
ATTENTION = ("sdpa", "eager")
LOGPROB_CHUNK = 1024  # tokens per LM-head chunk: [LOGPROB_CHUNK, V] float32 logits at a time


@dataclasses.dataclass
class KVCache:
    """Per-layer key/value buffers ``k[l], v[l]``: [B, S_max, K, D] (views into an engine pool)."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: [..., dim] -> [..., dim]; normalised in float32."""
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x``: [..., dim], ``weight``: [dim] -> [..., dim] in ``x``'s dtype; computed in float32 (the
    weight promoted inside the product: no float32 copy of it)."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight).to(x.dtype)


def rope_tables(positions: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary tables for ``positions`` [B, T]: (cos, sin) [B, T, 1, D] float32, the sin
    negated on the first half, so ``rope`` is two products, a sum and a swap of halves; made once
    per forward pass of the engine (each op is a kernel launch in a launch-bound decode step)."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d))
    ang = positions[..., None].float() * inv  # [B, T, D/2]
    cos, sin = torch.cos(ang), torch.sin(ang)
    return torch.cat([cos, cos], -1)[:, :, None], torch.cat([-sin, sin], -1)[:, :, None]


def rope(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``x``: [B, T, N, D] rotated by ``rope_tables`` -> [B, T, N, D] in ``x``'s dtype, float32
    inside: [x1 cos - x2 sin, x2 cos + x1 sin] (x1, x2 the halves of D; the same roundings)."""
    h = x.shape[-1] // 2
    x32 = x.float()
    cos, sin = tables
    return (x32 * cos + torch.cat([x32[..., h:], x32[..., :h]], -1) * sin).to(x.dtype)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """GQA attention. ``q``: [B, T, N, D]; ``k``, ``v``: [B, S, K, D] -> [B, T, N*D]. ``mask``: None
    (causal, S == T), an additive bias [B, 1, T, S] (SDPA) or a bool [B, T, S] (``attend_eager``)."""
    if mask is not None and mask.dtype == torch.bool:
        return attend_eager(q, k, v, mask)
    if mask is not None and q.is_cuda and k.shape[2] < q.shape[2]:
        return attend_masked_gqa(q, k, v, mask)
    b, t, n, d = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        enable_gqa=True,
    )
    return out.transpose(1, 2).reshape(b, t, n * d)


def attend_masked_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``attend`` with a bias ``mask`` [B, 1, T, S] and K < N heads, without SDPA's ``enable_gqa``: on
    CUDA no fused kernel takes GQA with a mask, and the math fallback materialises [B, N, T, S]
    float32 scores in several kernels. A decode step (T = 1) puts each kv head's N/K query heads on
    the query axis (a view; the mask broadcasts); a longer T repeats k, v per query head (as
    transformers' ``repeat_kv``). Either way the memory-efficient kernel takes it."""
    b, t, n, d = q.shape
    kh = k.shape[2]
    if t == 1:  # query head h reads kv head h // (N/K): kv head j's queries are heads j*N/K ...
        out = F.scaled_dot_product_attention(q.reshape(b, kh, n // kh, d), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)  # fmt: skip
        return out.reshape(b, 1, n * d)
    k, v = (x.repeat_interleave(n // kh, dim=2).transpose(1, 2) for x in (k, v))
    return (
        F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask)
        .transpose(1, 2)
        .reshape(b, t, n * d)
    )


def attend_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The eager reference: ``mask`` [B, T, S] bool (True = attend) -> [B, T, N*D]; float32 softmax."""
    b, t, n, d = q.shape
    rep = n // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("btnd,bsnd->bnts", q, k).float() / math.sqrt(d)
    scores = scores.masked_fill(~mask[:, None], torch.finfo(torch.float32).min)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.einsum("bnts,bsnd->btnd", probs, v).reshape(b, t, n * d)


def attention_bias(key_mask: torch.Tensor, q_slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA's additive mask: ``key_mask`` [B, S] bool, ``q_slots`` [T] (each query's key slot) ->
    [B, 1, T, S]: 0 on real keys at or before a query's slot and on its own slot, -inf elsewhere."""
    slot = torch.arange(key_mask.shape[1], device=key_mask.device)
    own = slot[None, :] == q_slots[:, None]  # [T, S]
    allowed = (slot[None, :] <= q_slots[:, None])[None] & (key_mask[:, None, :] | own[None])  # [B, T, S]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=key_mask.device)
    return bias.masked_fill_(~allowed, float("-inf"))[:, None]


def token_logprobs(
    x, targets, norm_weight, eps: float, head, temperature: float = 1.0, chunk: int | None = LOGPROB_CHUNK
) -> torch.Tensor:
    """``log_softmax(rms_norm(x) @ head.T / temperature)`` at ``targets``, float32 [B, T]; ``x``: [B,
    T, H] (before the final norm), ``head``: [V, H]; ``chunk`` tokens at a time (None: one pass)."""
    b, t, h = x.shape
    xs, ts = x.reshape(b * t, h), targets.reshape(b * t)
    if chunk is None:
        return _chunk_logprobs(xs, ts, norm_weight, head, eps, temperature).view(b, t)
    out = ChunkedLogProbs.apply(xs, ts, norm_weight, head, eps, temperature, chunk)
    return out.view(b, t)


class ChunkedLogProbs(torch.autograd.Function):
    """``token_logprobs`` over [N, H] rows, ``chunk`` rows at a time, recomputed in the backward;
    weight gradients summed over chunks in float32 and cast once (like one unchunked backward)."""

    @staticmethod
    def forward(ctx, x, targets, norm_weight, head, eps, temperature, chunk):  # type: ignore[override]
        ctx.save_for_backward(x, targets, norm_weight, head)
        ctx.eps, ctx.temperature, ctx.chunk = eps, temperature, chunk
        n = x.shape[0]
        parts = [
            _chunk_logprobs(x[s : s + chunk], targets[s : s + chunk], norm_weight, head, eps, temperature)
            for s in range(0, n, chunk)
        ]
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        x, targets, norm_weight, head = ctx.saved_tensors
        need_x, _, need_w, need_h = ctx.needs_input_grad[:4]
        c, n = ctx.chunk, x.shape[0]
        one = n <= c  # a single chunk: its gradients as they come, no float32 sums
        gx = torch.empty_like(x) if need_x else None
        gw: torch.Tensor | None = None
        gh: torch.Tensor | None = None
        for s in range(0, n, c):
            with torch.enable_grad():
                xc = x[s : s + c].detach().requires_grad_(need_x)
                w = norm_weight.detach().requires_grad_(need_w)
                hd = head.detach().requires_grad_(need_h)
                lp = _chunk_logprobs(xc, targets[s : s + c], w, hd, ctx.eps, ctx.temperature)
                wanted = [t for t, need in ((xc, need_x), (w, need_w), (hd, need_h)) if need]
                grads = iter(torch.autograd.grad(lp, wanted, grad[s : s + c]))
            if gx is not None:
                gx[s : s + c] = next(grads)
            if need_w:
                g = next(grads)
                gw = (g if one else g.float()) if gw is None else gw.add_(g)
            if need_h:
                g = next(grads)
                gh = (g if one else g.float()) if gh is None else gh.add_(g)
        gw = None if gw is None else gw.to(norm_weight.dtype)
        gh = None if gh is None else gh.to(head.dtype)
        return gx, None, gw, gh, None, None, None


def _chunk_logprobs(x, tgt, norm_weight, head, eps: float, temperature: float) -> torch.Tensor:
    """``x`` [C, H], ``tgt`` [C] -> [C] float32: one chunk of ``token_logprobs``."""
    logits = linear(rms_norm(x, norm_weight, eps), head).float()  # [C, V]
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, tgt[:, None])[:, 0] - torch.logsumexp(logits, dim=-1)


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose 16-bit CPU products run in float32 (``cpu_half.linear``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.c = c
        d = c.head_dim
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.q_proj = Linear(c.hidden_size, c.num_attention_heads * d, **kw)
        self.k_proj = Linear(c.hidden_size, c.num_key_value_heads * d, **kw)
        self.v_proj = Linear(c.hidden_size, c.num_key_value_heads * d, **kw)
        self.o_proj = Linear(c.num_attention_heads * d, c.hidden_size, **kw)
        self.q_norm = RMSNorm(d, c.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(d, c.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, positions, mask, kv=None, start: int = 0) -> torch.Tensor:
        """``x``: [B, T, H] -> [B, T, H]; ``positions``: [B, T], or their ``rope_tables``; ``mask``:
        as ``attend`` takes it, S = T, or with ``kv`` (k and v caches [B, S_max, K, D], this step's
        written at ``[start, start + T)``) S = start + T."""
        c, (b, t, _) = self.c, x.shape
        n, kh, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        # the trainer passes positions: FSDP2 would cast float tables to the compute dtype
        tables = positions if isinstance(positions, tuple) else rope_tables(positions, d, c.rope_theta)
        if kv is None:
            q = rope(self.q_norm(self.q_proj(x).view(b, t, n, d)), tables)
            k = rope(self.k_norm(self.k_proj(x).view(b, t, kh, d)), tables)
        else:  # the engine: q and k normed and rotated as one tensor, half the kernels of a decode step
            qk = torch.cat([self.q_proj(x).view(b, t, n, d), self.k_proj(x).view(b, t, kh, d)], 2)
            w = torch.cat([self.q_norm.weight.expand(n, d), self.k_norm.weight.expand(kh, d)])
            qk = rope(rms_norm(qk, w, c.rms_norm_eps), tables)
            q, k = qk[:, :, :n], qk[:, :, n:]
        v = self.v_proj(x).view(b, t, kh, d)
        if kv is not None:
            kv[0][:, start : start + t], kv[1][:, start : start + t] = k, v
            k, v = kv[0][:, : start + t], kv[1][:, : start + t]
        return self.o_proj(attend(q, k, v, mask))


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, **kw)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, **kw)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: ModelConfig, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.self_attn = Attention(c, dtype, device)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)
        self.mlp = MLP(c, dtype, device)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, mask, kv=None, start: int = 0
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, mask, kv, start)
        return x + self.mlp(self.post_attention_layernorm(x))


def run_block(
    layer: Block, x, positions, mask, remat: bool, dtype: torch.dtype | None = None, sharded: bool = False
) -> torch.Tensor:
    """One decoder layer of ``Qwen3.forward``: ``x`` [B, T, H], ``positions`` [B, T] -> [B, T, H].
    ``remat`` with grad: checkpointed with the weights captured now (swapped in again for the rerun,
    even after a ``functional_call`` was undone) and cast to ``dtype`` inside, so no cast is kept;
    ``sharded`` (FSDP2 hooks gather and cast): the layer's own call is checkpointed."""
    if not (remat and torch.is_grad_enabled()):
        if sharded or dtype is None or all(w.dtype == dtype for w in layer.parameters()):
            return layer(x, positions, mask)
        return _call_block(layer, dict(layer.named_parameters()), dtype, x, positions, mask)
    # the model draws no random numbers
    opts = {"use_reentrant": False, "preserve_rng_state": False}
    if sharded:
        return checkpoint(layer, x, positions, mask, **opts)
    return checkpoint(_call_block, layer, dict(layer.named_parameters()), dtype, x, positions, mask, **opts)


def _call_block(layer: Block, weights: dict, dtype: torch.dtype | None, x, positions, mask) -> torch.Tensor:
    """``layer(x, positions, mask)`` [B, T, H] with ``weights`` swapped in, cast to ``dtype``."""
    if dtype is not None:
        weights = {n: w.to(dtype) for n, w in weights.items()}
    return functional_call(layer, weights, (x, positions, mask), tie_weights=False)


class Qwen3Body(nn.Module):
    """``model.*`` of the HF layout: embeddings, decoder layers, final norm."""

    def __init__(self, c: ModelConfig, dtype: torch.dtype | None = None, device=None) -> None:
        super().__init__()
        # on meta, nn.Embedding's normal_ init would import torch._dynamo (about 1.5 s): skip it there
        meta = device is not None and torch.device(device).type == "meta"
        empty = torch.empty(c.vocab_size, c.hidden_size, dtype=dtype, device=device) if meta else None
        self.embed_tokens = nn.Embedding(
            c.vocab_size, c.hidden_size, dtype=dtype, device=device, _weight=empty
        )
        self.layers = nn.ModuleList([Block(c, dtype, device) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype, device)


class Qwen3(nn.Module):
    """``Qwen3(config)(tokens [B, T], attention_mask [B, T]) -> logits [B, T, V]`` (float32);
    with ``targets`` [B, T]: their log-probs [B, T]. ``attention``, ``logprob_chunk``, ``remat``
    and ``layer_dtype`` are plain attributes, switchable on a built model."""

    def __init__(
        self, c: ModelConfig, dtype=torch.float32, device=None, attention="sdpa", remat=False
    ) -> None:
        super().__init__()
        if attention not in ATTENTION:
            raise ValueError(f"attention {attention!r}: expected one of {', '.join(ATTENTION)}")
        self.config = c
        self.attention = attention
        self.logprob_chunk: int | None = LOGPROB_CHUNK
        self.remat = remat
        self.layer_dtype: torch.dtype | None = None
        self.sharded = False  # FSDP2 (``run_block``): set by the trainer that shards it
        self.model = Qwen3Body(c, dtype, device)
        self.lm_head = (
            None
            if c.tie_word_embeddings
            else nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=dtype, device=device)
        )

    def head(self) -> torch.Tensor:
        """The output projection [V, H] (the embedding matrix when tied)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm + head: [B, T, H] -> [B, T, V] float32."""
        return linear(self.model.norm(x), self.head()).float()

    def forward(self, tokens, attention_mask=None, targets=None, temperature: float = 1.0) -> torch.Tensor:
        """``tokens``: [B, T] int; ``attention_mask``: [B, T] (positions = cumsum(mask) - 1; None:
        causal only, also right padding) -> logits [B, T, V] float32; with ``targets`` [B, T]:
        ``log_softmax(logits / temperature)`` at ``targets``, [B, T]."""
        b, t = tokens.shape
        x = self.model.embed_tokens(tokens)
        eager = self.attention == "eager"
        causal = torch.ones(t, t, dtype=torch.bool, device=tokens.device).tril()[None] if eager else None
        if attention_mask is None:
            positions = torch.arange(t, device=tokens.device).expand(b, t)
            mask = causal.expand(b, t, t) if eager else None
        else:
            attention_mask = attention_mask.bool()
            positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
            if eager:
                mask = causal & attention_mask[:, None, :]  # [B, T, T]
            else:
                mask = attention_bias(attention_mask, torch.arange(t, device=tokens.device), x.dtype)
        for layer in self.model.layers:
            x = run_block(layer, x, positions, mask, self.remat, self.layer_dtype, self.sharded)
        if targets is None:
            return self.logits(x)
        norm = self.model.norm
        logp = token_logprobs(x, targets, norm.weight, norm.eps, self.head(), temperature, self.logprob_chunk)
        # FSDP2 hooks the root's output: a view could lose the hook to an in-place op
        return logp.clone() if self.sharded else logp

    def forward_cached(
        self, tokens, positions, key_mask, cache: KVCache, start: int, last_only: bool = False
    ) -> torch.Tensor:
        """Incremental forward for the engine: ``tokens``, ``positions`` [B, T]; ``key_mask`` [B, S]
        bool over cache slots (S >= start + T); new k/v go to slots ``[start, start + T)``. Returns
        logits [B, T, V] float32, or [B, 1, V] with ``last_only``."""
        t = tokens.shape[1]
        end = start + t
        q_slot = torch.arange(start, end, device=tokens.device)
        x = self.model.embed_tokens(tokens)
        tables = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        if self.attention == "eager":
            slot = torch.arange(end, device=tokens.device)
            mask = (slot[None, :] <= q_slot[:, None])[None] & key_mask[:, None, :end]  # [B, T, end]
        else:
            mask = attention_bias(key_mask[:, :end], q_slot, x.dtype)  # [B, 1, T, end]
        for i, layer in enumerate(self.model.layers):
            x = layer(x, tables, mask, (cache.k[i], cache.v[i]), start)
        return self.logits(x[:, -1:] if last_only else x)


def build_qwen3(c: ModelConfig, dtype: torch.dtype, device="meta", attention="sdpa", remat=False) -> Qwen3:
    """A ``Qwen3`` whose parameters live on ``device`` (``meta``: shapes only, no memory)."""
    return Qwen3(c, dtype, torch.device(device), attention, remat)


def to_torch(arr: np.ndarray) -> torch.Tensor:
    """A host numpy array (also a read-only memmap or bfloat16) as a CPU tensor, without a copy."""
    import warnings

    a = np.asarray(arr)
    with warnings.catch_warnings():  # memmaps are read-only; we only ever read them
        warnings.simplefilter("ignore", UserWarning)
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(a)


def checkpoint_dtype(model_dir: ModelDir) -> torch.dtype:
    return TORCH_DTYPES[next(iter(model_dir.tensors.values()))[1].dtype]


def load_qwen3(model_dir: ModelDir, dtype: torch.dtype | None = None, device: str = "cpu") -> Qwen3:
    """Build a ``Qwen3`` and stream the checkpoint into it, one tensor at a time."""
    dtype = dtype or checkpoint_dtype(model_dir)
    model = build_qwen3(model_dir.config, dtype, "meta").to_empty(device=device)
    params = dict(model.named_parameters())
    if set(params) != set(model_dir.tensors):
        raise ValueError(f"{model_dir.path}: tensor names do not match the Qwen3 parameters")
    with torch.no_grad():
        for name, arr in model_dir.iter_tensors():
            src = to_torch(arr)
            if tuple(src.shape) != tuple(params[name].shape):
                raise ValueError(
                    f"{name}: checkpoint {tuple(src.shape)} vs model {tuple(params[name].shape)}"
                )
            params[name].copy_(src)
    return model.eval()


@torch.no_grad()
def greedy_decode(model: Qwen3, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Reference greedy decoding by full re-forward: (token ids [T_out], their log-probs [T_out])."""
    device = model.head().device

    def step(ids: list[int]) -> tuple[int, float]:
        lp = torch.log_softmax(model(torch.tensor([ids], device=device))[0, -1], dim=-1)
        tok = int(lp.argmax())
        return tok, float(lp[tok])

    return greedy_loop(step, prompt, max_new_tokens, model.config.eos_token_id)

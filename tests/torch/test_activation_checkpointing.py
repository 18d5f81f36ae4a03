"""Per-block activation checkpointing of the torch Qwen3 (``Qwen3.remat``, the torch trainer's
``--model-option remat=true``; ``backends/torch/model.py: run_block``, ``backends/torch/options.py``):
the same log-probs and gradients as without, float32 and mixed precision (bf16 compute on float32
masters swapped in by ``functional_call``), LoRA and KL included; forwards without grad untouched;
less activation memory, counted two ways (MemTracker on real CPU tensors, the planner's fake-tensor
trainer step); the option's parsing and refusals. Mixed precision with remat (full fine-tune): each
layer casts its float32 masters inside its checkpoint (``Qwen3.layer_dtype``): bit for bit the
numbers of the casts made up front (with and without remat), the KL reference, ``logprobs`` and
``greedy`` untouched, and the bf16 copies of all but one layer gone from the forward/backward peak
(MemTracker on real CPU tensors, the planner's fake-tensor trainer step)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker
from torch.func import functional_call

from mllm_rl.backends.torch import memplan
from mllm_rl.backends.torch import model as model_mod
from mllm_rl.backends.torch.model import build_qwen3
from mllm_rl.backends.torch.options import TorchModelOptions, remat_flag
from mllm_rl.backends.torch.trainer import LAYER_PREFIX, TorchTrainer
from mllm_rl.presets import get_preset
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.trainer import RolloutBatch, TrainConfig
from tests.torch.test_trainer import capture_grads

pytestmark = pytest.mark.usefixtures("one_thread")

# tiny with 3 layers, a vocabulary the head's chunks do not divide
CFG = dataclasses.replace(get_preset("tiny"), num_hidden_layers=3, vocab_size=200)
B, T = 3, 24
MASK = torch.ones(B, T, dtype=torch.bool)
MASK[1, :5] = False  # left padding: the masked (attention bias) path
REMAT = (("remat", True),)
# float32 reductions in the same order: the recompute is the same ops on the same tensors (seen: equal)
TIGHT = {"rtol": 1e-6, "atol": 1e-7}


def random_model(dtype: torch.dtype = torch.float32, remat: bool = False, config=CFG, seed: int = 0):
    """A ``Qwen3`` of ``config`` with seeded random weights in ``dtype`` (norms ~1, the rest ~0.08)."""
    torch.manual_seed(seed)
    m = build_qwen3(config, torch.float32, "cpu", remat=remat)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    return m.to(dtype)


def tokens(seed: int = 1, b: int = B, t: int = T, vocab: int = CFG.vocab_size) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g)


def logp_and_grads(
    m,
    toks: torch.Tensor,
    mask: torch.Tensor | None,
    compute: torch.dtype | None = None,
    layer_casts: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The next-token log-probs [B, T-1] (temperature 0.7) and every parameter's gradient of their
    sum; ``compute``: through ``functional_call`` on casts of the params to it (the trainer's mixed
    precision); ``layer_casts``: only the non-layer params cast up front, each decoder layer casting
    its own inside its function (``Qwen3.layer_dtype``, the trainer's ``layer_casts``)."""
    m.zero_grad(set_to_none=True)
    m.layer_dtype = compute if layer_casts else None
    lp = _logp(m, toks, mask, compute, layer_casts)
    lp.sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


def _logp(m, toks, mask, compute, layer_casts: bool = False) -> torch.Tensor:
    """``logp_and_grads``'s forward; its casts dict dies when it returns, as the trainer's does."""
    args = (toks[:, :-1], None if mask is None else mask[:, :-1])
    kwargs = {"targets": toks[:, 1:], "temperature": 0.7}
    if compute is None:
        return m(*args, **kwargs)
    casts = {
        n: p.to(compute) for n, p in m.named_parameters() if not (layer_casts and n.startswith(LAYER_PREFIX))
    }
    return functional_call(m, casts, args, kwargs)


def assert_same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Bit for bit: dtype, shape and every value."""
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), f"{what}: max |diff| {(a.double() - b.double()).abs().max()}"


# -- exactness ------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [None, MASK], ids=["causal", "left_padded"])
def test_fp32_logprobs_and_gradients_equal_without_remat(mask):
    m, toks = random_model(), tokens()
    runs = {}
    for remat in (False, True):
        m.remat = remat
        runs[remat] = logp_and_grads(m, toks, mask)
    (lp0, g0), (lp1, g1) = runs[False], runs[True]
    torch.testing.assert_close(lp1, lp0, **TIGHT)
    assert g0.keys() == g1.keys()
    for n in g0:
        assert g0[n].abs().max() > 0, n
        torch.testing.assert_close(g1[n], g0[n], **TIGHT, msg=n)


@pytest.mark.parametrize("mask", [None, MASK], ids=["causal", "left_padded"])
def test_mixed_precision_recompute_uses_the_swapped_casts(mask):
    """bf16 casts of float32 masters swapped in with ``functional_call`` (the trainer's mixed
    precision): the rerun in the backward runs after the swap is undone, yet computes on the same
    bf16 casts (a rerun on the float32 masters would fail: bf16 activations meet float32 weights)
    and the float32 gradients reach the masters equal to the un-checkpointed ones."""
    m, toks = random_model(torch.float32), tokens()
    runs = {}
    for remat in (False, True):
        m.remat = remat
        runs[remat] = logp_and_grads(m, toks, mask, compute=torch.bfloat16)
    (lp0, g0), (lp1, g1) = runs[False], runs[True]
    torch.testing.assert_close(lp1, lp0, **TIGHT)
    for n in g0:
        assert g1[n].dtype == torch.float32 and g0[n].abs().max() > 0, n
        torch.testing.assert_close(g1[n], g0[n], **TIGHT, msg=n)


@pytest.mark.parametrize("mask", [None, MASK], ids=["causal", "left_padded"])
def test_layer_casts_inside_the_checkpoint_are_bit_identical(mask):
    """float32 masters, bf16 compute: each layer casting its masters inside its checkpointed function
    (``layer_dtype``, only embeddings / final norm / head cast up front) gives bit for bit the
    log-probs and float32 gradients of every weight cast up front, with remat (today's path) and
    without; without remat, the layers' casts made just before each layer (the plain path) too."""
    m, toks = random_model(torch.float32), tokens()
    runs = {}
    for remat, layer_casts in ((False, False), (True, False), (True, True), (False, True)):
        m.remat = remat
        runs[remat, layer_casts] = logp_and_grads(m, toks, mask, torch.bfloat16, layer_casts)
    lp0, g0 = runs[False, False]
    assert lp0.dtype == torch.float32
    for key, (lp, g) in runs.items():
        assert_same(lp, lp0, f"log-probs {key}")
        assert g.keys() == g0.keys()
        for n in g0:
            assert g[n].dtype == torch.float32 and g0[n].abs().max() > 0, n
            assert_same(g[n], g0[n], f"{n} {key}")


def test_layer_casts_are_made_in_the_layers_function(monkeypatch):
    """With ``layer_dtype`` and grad: every decoder layer's checkpointed function gets the layer's
    float32 masters (the leaves themselves, not casts) and the dtype to cast them to inside it, in
    the forward and again in the rerun."""
    seen: list[tuple[set[torch.dtype], bool, torch.dtype | None]] = []
    real = model_mod._call_block

    def spying(layer, weights, dtype, *args):
        leaves = all(w.is_leaf and w.requires_grad for w in weights.values())
        seen.append(({w.dtype for w in weights.values()}, leaves, dtype))
        return real(layer, weights, dtype, *args)

    monkeypatch.setattr(model_mod, "_call_block", spying)
    m, toks = random_model(torch.float32, remat=True), tokens()
    logp_and_grads(m, toks, MASK, torch.bfloat16, layer_casts=True)
    # forward + rerun of every layer
    assert seen == [({torch.float32}, True, torch.bfloat16)] * (2 * CFG.num_hidden_layers)


def test_layer_dtype_without_grad_uses_weights_already_cast(monkeypatch):
    """No grad (the trainer's ``logprobs``, ``greedy``, the KL reference: every weight swapped in
    already in bf16): ``layer_dtype`` changes nothing, each layer a plain call (no ``_call_block``,
    no copy), the same log-probs; float32 layers without grad are cast before each layer, same
    numbers as casts made up front."""
    calls = []
    real = model_mod._call_block

    def counting(*args):
        calls.append(args[2])
        return real(*args)

    monkeypatch.setattr(model_mod, "_call_block", counting)
    m, toks = random_model(torch.float32, remat=True), tokens()
    with torch.no_grad():
        m.layer_dtype = None
        want = _logp(m, toks, MASK, torch.bfloat16)
        m.layer_dtype = torch.bfloat16
        got = _logp(m, toks, MASK, torch.bfloat16)
        assert not calls
        per_layer = _logp(m, toks, MASK, torch.bfloat16, layer_casts=True)
    assert calls == [torch.bfloat16] * CFG.num_hidden_layers
    assert_same(got, want, "all cast up front")
    assert_same(per_layer, want, "cast before each layer")


def test_every_layer_is_checkpointed_with_grad_and_none_without(monkeypatch):
    """With grad: one ``checkpoint`` per decoder layer; under ``no_grad`` (log-probs, the KL
    reference, the engine's cached path): none, and the same log-probs."""
    calls = []
    real = model_mod.checkpoint

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_mod, "checkpoint", counting)
    m, toks = random_model(remat=True), tokens()
    lp = m(toks[:, :-1], targets=toks[:, 1:])
    assert len(calls) == CFG.num_hidden_layers
    assert all(c["use_reentrant"] is False for c in calls)
    with torch.no_grad():
        calls.clear()
        again = m(toks[:, :-1], targets=toks[:, 1:])
        m.remat = False
        plain = m(toks[:, :-1], targets=toks[:, 1:])
    assert not calls
    torch.testing.assert_close(again, plain, rtol=0, atol=0)
    torch.testing.assert_close(lp.detach(), plain, **TIGHT)


# -- the trainer ----------------------------------------------------------------------------------
def batch(b: int = 4, t: int = 20, seed: int = 0) -> RolloutBatch:
    """``b`` rows of [prompt | completion | right padding], old log-probs near a random model's."""
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, CFG.vocab_size, (b, t)).astype(np.int32)
    attn = np.ones((b, t), bool)
    attn[0, t - 3 :] = False
    loss = attn.copy()
    loss[:, : t // 2] = False
    old = np.where(loss, rng.normal(-5.3, 0.3, (b, t)), 0).astype(np.float32)
    return RolloutBatch(toks, attn, loss, old, rng.normal(0, 1, b).astype(np.float32))


def one_step(
    dtype: str, remat: bool, lora_rank: int, beta: float, layer_casts: bool = True
) -> tuple[dict, list, dict]:
    """One ``TorchTrainer.train_step`` (two micro-batches) of a random model whose checkpoint dtype
    is ``dtype`` (bfloat16: mixed precision, float32 masters computing in bf16): (metrics, the
    trainable gradients the optimizer got, the trainable params after). ``layer_casts=False``: the
    trainer's layer casts (mixed precision, full fine-tune, remat) turned off, every master cast up
    front (the remat path before them)."""
    base = random_model(torch.float32).to(getattr(torch, dtype))
    cfg = TrainConfig(
        lr=1e-2,
        micro_batch_size=2,
        lora_rank=lora_rank,
        loss=LossConfig(beta=beta),
        model_options=REMAT if remat else (),
    )
    t = TorchTrainer(memplan.layout_dir(CFG, dtype), cfg, model=base)
    assert t.model.remat is remat and t.options.remat is remat
    casting = remat and dtype == "bfloat16" and not lora_rank  # the trainer's layer casts
    assert t.layer_casts is casting
    assert t.model.layer_dtype == (torch.bfloat16 if casting else None)
    if not layer_casts:
        t.layer_casts, t.model.layer_dtype = False, None
    seen = capture_grads(t)
    metrics = t.train_step(batch())
    after = {n: p.detach().clone() for n, p in t.trainable.items()}
    return metrics, seen[0], after


@pytest.mark.parametrize(
    "dtype, lora_rank, beta",
    [("float32", 0, 0.0), ("bfloat16", 0, 0.05), ("bfloat16", 4, 0.05)],
    ids=["fp32", "bf16_mixed_kl", "bf16_mixed_lora_kl"],
)
def test_trainer_step_with_remat_equals_without(dtype, lora_rank, beta):
    """The real ``TorchTrainer`` step, ``--model-option remat=true`` vs the default: the same
    metrics, gradients (float32: the masters'/adapters') and updated params."""
    m0, g0, p0 = one_step(dtype, False, lora_rank, beta)
    m1, g1, p1 = one_step(dtype, True, lora_rank, beta)
    for k in ("loss", "grad_norm", "clip_frac", "kl", "ratio_mean", "neg_logp_mean", "tokens"):
        assert m1[k] == pytest.approx(m0[k], rel=1e-6, abs=1e-9), k
    assert m0["grad_norm"] > 0
    for a, b in zip(g0, g1, strict=True):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, **TIGHT)
    for n in p0:
        torch.testing.assert_close(p1[n], p0[n], **TIGHT, msg=n)


@pytest.mark.parametrize("dtype, beta", [("float32", 0.05), ("bfloat16", 0.05), ("bfloat16", 0.0)])
def test_trainer_step_is_bit_identical(dtype, beta):
    """The trainer's step, bit for bit: without remat, remat with every master cast up front (the
    path before layer casts) and remat with layer casts (bf16 mixed precision; float32 has none):
    the same loss and metrics, the same float32 gradients reaching the optimizer, the same updated
    masters (KL reference included with ``beta``)."""
    runs = {
        "plain": one_step(dtype, False, 0, beta),
        "remat_up_front": one_step(dtype, True, 0, beta, layer_casts=False),
        "remat": one_step(dtype, True, 0, beta),
    }
    m0, g0, p0 = runs["plain"]
    assert m0["grad_norm"] > 0
    for name, (m, g, p) in runs.items():
        for k in ("loss", "grad_norm", "clip_frac", "kl", "ratio_mean", "neg_logp_mean", "tokens"):
            assert m[k] == m0[k], (name, k)
        for i, (a, b) in enumerate(zip(g0, g, strict=True)):
            assert b.dtype == torch.float32
            assert_same(b, a, f"{name} grad {i}")
        for n in p0:
            assert_same(p[n], p0[n], f"{name} {n}")


def test_trainer_no_grad_paths_are_unchanged_by_layer_casts(monkeypatch):
    """bf16 mixed precision with remat (layer casts on): ``logprobs``, ``greedy`` and the KL
    reference's log-probs (``_ref_logp``, bf16 params swapped in) cast nothing inside a layer (every
    layer a plain call on weights already bf16) and equal, bit for bit, the trainer without remat."""
    calls = []
    real = model_mod._call_block
    monkeypatch.setattr(model_mod, "_call_block", lambda *a: calls.append(a) or real(*a))
    out = {}
    for opts in ((), REMAT):
        cfg = TrainConfig(micro_batch_size=2, loss=LossConfig(beta=0.05), model_options=opts)
        t = TorchTrainer(memplan.layout_dir(CFG, "bfloat16"), cfg, model=random_model().to(torch.bfloat16))
        assert t.layer_casts is bool(opts)
        mb = next(t._micro_batches(batch()))
        ref = {n: h.to(t.compute_dtype) for n, h in t.trainable.items()}
        with torch.enable_grad():  # the step calls it with grad on; it turns grad off itself
            ref_logp = t._ref_logp(mb, ref)
        out[opts] = (t.logprobs(batch()), t.greedy([1, 2, 3], 4), ref_logp)
    assert not calls
    (lp0, gr0, ref0), (lp1, gr1, ref1) = out[()], out[REMAT]
    np.testing.assert_array_equal(lp1, lp0)
    assert gr1 == gr0
    assert_same(ref1, ref0, "KL reference log-probs")


def test_trainer_logprobs_are_unchanged_by_remat():
    """``logprobs`` runs without grad: no checkpoint, the same numbers."""
    out = []
    for opts in ((), REMAT):
        t = TorchTrainer(
            memplan.layout_dir(CFG, "float32"), TrainConfig(model_options=opts), model=random_model()
        )
        out.append(t.logprobs(batch()))
    np.testing.assert_array_equal(out[1], out[0])


# -- memory ---------------------------------------------------------------------------------------
DEEP = dataclasses.replace(get_preset("tiny"), num_hidden_layers=6)


def tracked_peak(remat: bool, seq: int) -> dict[str, int]:
    """MemTracker's per-category peak bytes (real CPU tensors) of one forward + backward of the
    float32 ``DEEP`` model over 1 x ``seq`` tokens."""
    m = random_model(remat=remat, config=DEEP)
    toks = tokens(b=1, t=seq + 1, vocab=DEEP.vocab_size)
    tracker = MemTracker()
    tracker.track_external(m)
    with tracker:
        m(toks[:, :-1], targets=toks[:, 1:]).mean().backward()
    out: dict[str, int] = {}
    for per_dev in tracker.get_tracker_snapshot("peak").values():
        for k, v in per_dev.items():
            out[str(getattr(k, "value", k))] = int(v)
    return out


def test_remat_lowers_the_measured_activation_peak():
    """MemTracker on real tensors: the activations at the peak of a 6-layer float32 forward +
    backward over 1 x 1024 tokens drop by more than 3x (seen 4.3x: ~44 MiB kept per layer
    without, one layer's rerun plus each layer's [T, H] input with), the total peak by 2x."""
    plain, remat = tracked_peak(False, 1024), tracked_peak(True, 1024)
    assert plain["Activation"] > 3 * remat["Activation"], (plain, remat)
    assert plain["Total"] > 2 * remat["Total"], (plain, remat)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planner_counts_fewer_activations_with_remat(dtype):
    """The planner's fake-tensor ``TorchTrainer`` step (what ``python -m mllm_rl.memplan --backend
    torch --model-option remat=true`` plans), 6 layers, 1 x 2048 tokens: activations + temporaries
    drop by more than 3x (seen 5.4x float32, 4.8x bf16 mixed); params, gradients and optimizer
    state do not change."""
    plain = memplan.trainer_step_memory(DEEP, 1, 2048, rows=1, dtype=dtype, steps=1)
    remat = memplan.trainer_step_memory(DEEP, 1, 2048, rows=1, dtype=dtype, steps=1, options=REMAT)
    assert plain.activations > 3 * remat.activations, (plain.activations, remat.activations)
    assert (remat.params, remat.grads, remat.optimizer) == (plain.params, plain.grads, plain.optimizer)
    assert remat.options == REMAT and plain.options == ()


# 8 layers over a few tokens: a layer's weights weigh more than its activations
WIDE = dataclasses.replace(get_preset("tiny"), num_hidden_layers=8)
LAYER_CAST_BYTES = sum(
    2 * int(np.prod(s)) for n, s in WIDE.param_shapes().items() if n.startswith("model.layers.0.")
)


def mixed_remat_peak(layer_casts: bool, seq: int = 64) -> int:
    """Total peak bytes (MemTracker on real CPU tensors) of one forward + backward of the ``WIDE``
    model, remat on, float32 masters computing in bf16 over 1 x ``seq`` tokens, the float32
    gradients already allocated (a micro-batch after the first of an accumulation: the trainer's
    forward/backward peak); ``layer_casts``: each layer casting its masters in its checkpoint, else
    every master cast up front."""
    m = random_model(remat=True, config=WIDE)
    m.layer_dtype = torch.bfloat16 if layer_casts else None
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    toks = tokens(b=1, t=seq + 1, vocab=WIDE.vocab_size)
    tracker = memplan._tracker_class()()  # no gradient hooks on the non-leaf casts
    tracker.track_external(m)
    with tracker:
        tracker._track_module_params_and_buffers(m)  # the masters' hooks, before casts are swapped in
        _logp(m, toks, None, torch.bfloat16, layer_casts).sum().backward()
    return memplan._bytes(tracker.get_tracker_snapshot("peak"))["Total"]


def test_layer_casts_lower_the_measured_peak_by_all_but_one_layers_casts():
    """MemTracker on real tensors, remat + mixed precision: casting each layer's masters inside its
    checkpoint takes the bf16 copies of all decoder layers but (at most) one out of the
    forward/backward peak: the drop lies between 7 and 8 layers' bf16 weights of the 8 (seen 7.4)."""
    up_front, per_layer = mixed_remat_peak(False), mixed_remat_peak(True)
    drop = up_front - per_layer
    layers = WIDE.num_hidden_layers
    assert (layers - 1) * LAYER_CAST_BYTES <= drop <= layers * LAYER_CAST_BYTES, drop / LAYER_CAST_BYTES


def test_planner_counts_the_layer_casts_one_layer_at_a_time(monkeypatch):
    """The planner's fake-tensor ``TorchTrainer`` step (bf16 checkpoint: float32 masters, remat), 8
    layers, 2 micro-batches of 1 x 64 tokens: the forward/backward peak is lower than with every
    master cast up front (``_compute_params`` made to cast the layers too: the path before) by
    between 7 and 8 layers' bf16 weights (seen 7.4); params, gradients and optimizer state equal."""
    args = (WIDE, 1, 64)
    kw = {"rows": 2, "dtype": "bfloat16", "steps": 1, "options": REMAT}
    trace = memplan.trainer_step_memory.__wrapped__  # not the cache: the same arguments twice
    per_layer = trace(*args, **kw)
    real = TorchTrainer._compute_params
    monkeypatch.setattr(TorchTrainer, "_compute_params", lambda self, layers=True: real(self))
    up_front = trace(*args, **kw)
    drop = up_front.fwd_bwd_peak["Total"] - per_layer.fwd_bwd_peak["Total"]
    layers = WIDE.num_hidden_layers
    assert (layers - 1) * LAYER_CAST_BYTES <= drop <= layers * LAYER_CAST_BYTES, drop / LAYER_CAST_BYTES
    assert per_layer.peak_total <= up_front.peak_total
    assert (per_layer.params, per_layer.grads, per_layer.optimizer) == (
        up_front.params,
        up_front.grads,
        up_front.optimizer,
    )


# -- the option -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, flag",
    [(True, True), (False, False), (None, False), ("block", True), ("None", False), ("TRUE", True)],
)
def test_remat_values(value, flag):
    assert remat_flag(value) is flag
    assert TorchModelOptions.from_pairs([("remat", value)]).remat is flag


@pytest.mark.parametrize(
    "pairs, match",
    [((("remat", "dots"),), "remat='dots'"), ((("remat", 1),), "remat=1"),
     ((("scan_layers", True),), "--model-option scan_layers: unknown")],
)  # fmt: skip
def test_bad_options_are_refused_by_the_trainer_and_the_backend(pairs, match):
    from mllm_rl.backends.torch import TorchBackend

    with pytest.raises(ValueError, match=match):
        TorchTrainer(
            memplan.layout_dir(CFG, "float32"), TrainConfig(model_options=pairs), model=random_model()
        )
    with pytest.raises(ValueError, match=match):
        TorchBackend().check_trainer_args(None, TrainConfig(model_options=pairs))  # type: ignore[arg-type]
    TorchBackend().check_trainer_args(None, TrainConfig(model_options=REMAT))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--trainer-tp 2"):
        TorchBackend().check_trainer_args(None, TrainConfig(model_options=REMAT, trainer_tp=2))  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match="--checkpoint-compression: the torch trainer writes its state uncompressed"
    ):
        TorchBackend().check_trainer_args(None, TrainConfig(checkpoint_compression=True))  # type: ignore[arg-type]

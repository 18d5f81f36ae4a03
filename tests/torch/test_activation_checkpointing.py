"""Per-block activation checkpointing of the torch Qwen3 (``Qwen3.remat``, the torch trainer's
``--model-option remat=true``; ``backends/torch/model.py: run_block``, ``backends/torch/options.py``):
the same log-probs and gradients as without, float32 and mixed precision (bf16 compute on float32
masters swapped in by ``functional_call``), LoRA and KL included; forwards without grad untouched;
less activation memory, counted two ways (MemTracker on real CPU tensors, the planner's fake-tensor
trainer step); the option's parsing and refusals."""

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
from mllm_rl.backends.torch.trainer import TorchTrainer
from mllm_rl.presets import get_preset
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.trainer import RolloutBatch, TrainConfig

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
    m, toks: torch.Tensor, mask: torch.Tensor | None, compute: torch.dtype | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The next-token log-probs [B, T-1] (temperature 0.7) and every parameter's gradient of their
    sum; ``compute``: through ``functional_call`` on casts of the params to it (the trainer's mixed
    precision)."""
    m.zero_grad(set_to_none=True)
    args = (toks[:, :-1], None if mask is None else mask[:, :-1])
    kwargs = {"targets": toks[:, 1:], "temperature": 0.7}
    if compute is None:
        lp = m(*args, **kwargs)
    else:
        casts = {n: p.to(compute) for n, p in m.named_parameters()}
        lp = functional_call(m, casts, args, kwargs)
    lp.sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}


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


def one_step(dtype: str, remat: bool, lora_rank: int, beta: float) -> tuple[dict, list, dict]:
    """One ``TorchTrainer.train_step`` (two micro-batches) of a random model whose checkpoint dtype
    is ``dtype`` (bfloat16: mixed precision, float32 masters computing in bf16): (metrics, the
    trainable gradients the optimizer got, the trainable params after)."""
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
    seen: list[list[torch.Tensor]] = []
    step = t.optimizer.step

    def capturing_step() -> None:
        seen.append([p.grad.clone() for p in t.trainable.values()])
        step()

    t.optimizer.step = capturing_step  # type: ignore[method-assign]
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


# -- the benchmark --------------------------------------------------------------------------------
def test_bench_torch_remat_runs_on_tiny(tmp_path):
    """``scripts/bench_torch_remat.py`` end to end on tiny at 1 x 256: both paths measured, the
    ratios remat / plain, the JSON summary last; the planner predicts fewer activations for remat."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT

    saved = tmp_path / "out.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts/bench_torch_remat.py"), "--seq", "256", "--steps", "1",
                        "--json", str(saved)], capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "torch_remat" and out["figure"] == "CPU"
    assert set(out["remat_over_plain"]) == {"step_s", "rss_peak_rise", "planned_activations"}
    assert out["remat_over_plain"]["planned_activations"] < 1
    full = json.loads(saved.read_text())
    assert set(full["paths"]) == {"plain", "remat"}

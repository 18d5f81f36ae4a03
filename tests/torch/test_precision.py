"""Precision and temperature of the torch trainer (``backends/torch/trainer.py``).

A bf16 checkpoint (Qwen3's are bf16) under ``precision="mixed"`` (the default) trains float32
masters with float32 AdamW moments and computes in bf16; ``"pure"`` keeps params and moments
in bf16, where an AdamW step of ~lr (1e-6) is below half a bf16 ulp of a weight ~0.02 (6e-5)
and rounds away. Every log-prob is ``log_softmax(logits / temperature)``.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mllm_rl.backends.torch.engine import EmbeddedEngine, tensor_sums
from mllm_rl.backends.torch.model import load_qwen3
from mllm_rl.backends.torch.trainer import TorchTrainer
from mllm_rl.checkpoint import ModelDir
from mllm_rl.checkpoint.make import make_checkpoint
from mllm_rl.engine import SamplingParams, compare_fingerprints
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.presets import PRESETS
from mllm_rl.rl.batch import build_batch
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.trainer import OPTIMIZER, PARAMS, RolloutBatch, TrainConfig
from tests.torch.test_trainer import PROMPT, make_batch

BF16, FP32 = torch.bfloat16, torch.float32


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> ModelDir:
    out = tmp_path_factory.mktemp("ckpt") / "tiny-bf16"
    return ModelDir.open(make_checkpoint(PRESETS["tiny"], out, dtype="bfloat16", show_progress=False))


@pytest.fixture(scope="module")
def fp32_dir(tiny_ckpt) -> ModelDir:
    return ModelDir.open(tiny_ckpt)


def masters(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.trainable.items()}


def opt_state(t: TorchTrainer) -> list[torch.Tensor]:
    return [v.clone() for st in t.optimizer.state.values() for v in st.values()]


def changed_fraction(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    changed = sum(int((a[n] != b[n]).sum()) for n in a)
    return changed / sum(x.numel() for x in a.values())


def two_steps(model_dir: ModelDir, **kw) -> tuple[TorchTrainer, float]:
    """Two steps at lr 1e-6 on batches with non-zero advantages: the trainer and the fraction of
    its trainable elements the second step changed."""
    t = TorchTrainer(model_dir, TrainConfig(lr=1e-6, **kw))
    t.train_step(make_batch(seed=0))
    p1 = masters(t)
    t.train_step(make_batch(seed=1))
    return t, changed_fraction(p1, masters(t))


def reference_logp(model: torch.nn.Module, batch: RolloutBatch, temperature: float) -> np.ndarray:
    """float64 log_softmax(logits / T) at the batch's tokens from ``model``'s untempered logits,
    [B, T] (0 at t = 0 and on padding)."""
    tokens = torch.from_numpy(batch.tokens.astype(np.int64))
    attn = torch.from_numpy(batch.attention_mask)
    with torch.no_grad():
        logits = model(tokens[:, :-1], attn[:, :-1]).double()
    lp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
    out = np.zeros(batch.tokens.shape)
    out[:, 1:] = lp.numpy()
    return np.where(batch.attention_mask, out, 0.0)


# -- mixed precision -----------------------------------------------------------------------
def test_mixed_precision_learns_at_lr_1e6_and_resumes_exactly(bf16_dir, tmp_path, monkeypatch):
    """A bf16 checkpoint under mixed precision learns at lr 1e-6, and its trainer state, written as
    several files as a real model's is (one per core, ``state_file.shard_count``), resumes bit for
    bit."""
    from mllm_rl.backends.torch import state_file

    monkeypatch.setattr(state_file, "shard_count", lambda nbytes: 3)
    t = TorchTrainer(bf16_dir, TrainConfig(lr=1e-6))
    assert all(p.dtype == FP32 for p in t.trainable.values())
    assert all(v.dtype == FP32 for v in opt_state(t) if v.dim())  # exp_avg, exp_avg_sq
    n = sum(p.numel() for p in t.trainable.values())
    assert t.state_bytes() == {PARAMS: 4 * n, OPTIMIZER: 2 * 4 * n + 4 * len(t.trainable)}  # + step counters
    t.train_step(make_batch(seed=0))
    p1, o1 = masters(t), opt_state(t)
    t.save(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.1.pt", "state.2.pt", "state.pt"]
    snap = t.snapshot()
    assert all(v.dtype == FP32 for v in snap.state["trainable"].values())
    t.offload([PARAMS, OPTIMIZER])  # float32 masters and moments round-trip bit for bit
    assert t.state_bytes() == {PARAMS: 0, OPTIMIZER: 0}
    t.onload([PARAMS, OPTIMIZER])
    assert all(torch.equal(p1[k], v) for k, v in masters(t).items())
    t.train_step(make_batch(seed=1))
    p2 = masters(t)
    assert changed_fraction(p1, p2) >= 0.9  # measured 0.944; the rest: embedding rows of unseen tokens
    # the engine gets bf16 casts of the masters, and the fingerprint hashes exactly those
    export = dict(t.export_weights())
    assert list(export) == t.names
    fp = t.weights_fingerprint()
    for name, value in export.items():
        assert value.dtype == BF16 and torch.equal(value, p2[name].to(BF16)), name
        assert fp[name] == tuple(float(x) for x in tensor_sums(p2[name].to(BF16))), name
    # resume: a new trainer restored from step 1 takes the same step 2, bit for bit
    r = TorchTrainer(bf16_dir, TrainConfig(lr=1e-6))
    r.restore(tmp_path)
    assert r.step == 1 and all(torch.equal(p1[k], v) for k, v in masters(r).items())
    assert all(torch.equal(a, b) for a, b in zip(o1, opt_state(r), strict=True))
    r.train_step(make_batch(seed=1))
    assert all(torch.equal(p2[k], v) for k, v in masters(r).items())
    assert all(torch.equal(a, b) for a, b in zip(opt_state(t), opt_state(r), strict=True))


def test_pure_precision_bf16_loses_small_updates(bf16_dir):
    """The documented risk of ``precision="pure"``: at lr 1e-6 almost no bf16 weight moves
    (measured: 0.26% of the elements on the second step)."""
    t, frac = two_steps(bf16_dir, precision="pure")
    assert all(p.dtype == BF16 for p in t.trainable.values())
    assert frac < 0.1


def test_restoring_another_precisions_checkpoint_fails_in_one_line(bf16_dir, tmp_path):
    TorchTrainer(bf16_dir, TrainConfig(precision="pure")).save(tmp_path)
    mixed = TorchTrainer(bf16_dir, TrainConfig())
    with pytest.raises(ValueError) as err:
        mixed.restore(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path / "state.pt") in msg
    assert "torch.bfloat16" in msg and "torch.float32" in msg and "'pure'" in msg and "'mixed'" in msg


def test_mixed_computes_in_the_checkpoint_dtype(bf16_dir):
    """Log-probs of the float32 masters equal those of a bf16 model (what a bf16 engine computes),
    not those of the same values in float32; step 0 of mixed and pure computes the same loss."""
    batch = make_batch(seed=2)
    mixed, pure = TorchTrainer(bf16_dir, TrainConfig()), TorchTrainer(bf16_dir, TrainConfig(precision="pure"))
    got = mixed.logprobs(batch)
    np.testing.assert_array_equal(got, pure.logprobs(batch))
    fp32 = reference_logp(load_qwen3(bf16_dir, dtype=FP32), batch, 1.0)
    assert np.abs(got - fp32).max() > 1e-3  # bf16 compute is visibly not float32 compute
    assert mixed.train_step(batch)["loss"] == pure.train_step(batch)["loss"]
    toks = mixed.greedy(PROMPT, 6)[0]
    assert toks == pure.greedy(PROMPT, 6)[0]


@pytest.mark.parametrize("precision", ["mixed", "pure"])
def test_kl_reference_of_mixed_precision_is_the_initial_bf16_policy(bf16_dir, precision):
    t = TorchTrainer(bf16_dir, TrainConfig(lr=1e-4, precision=precision, loss=LossConfig(beta=0.1)))
    assert all(t.ref_host[n].nbytes == 2 * p.numel() for n, p in t.trainable.items())  # held in bf16
    batch = make_batch(seed=3)
    batch.old_logp[:] = t.logprobs(batch)
    m = t.train_step(batch)
    assert m["kl"] == 0 and m["ratio_mean"] == 1.0
    assert t.train_step(make_batch(seed=4))["kl"] > 0


def test_lora_on_bf16_trains_float32_adapters_over_a_bf16_base(bf16_dir):
    t = TorchTrainer(bf16_dir, TrainConfig(lr=1e-3, lora_rank=4))
    frozen = {n: p for n, p in t.params.items() if n not in t.trainable}
    assert set(frozen) == set(t.names) and all(p.dtype == BF16 for p in frozen.values())
    assert len(t.trainable) == 2 * len(t.adapters) and all(p.dtype == FP32 for p in t.trainable.values())
    assert all(v.dtype == FP32 for v in opt_state(t) if v.dim())
    base = {n: p.detach().clone() for n, p in frozen.items()}
    before = masters(t)
    t.train_step(make_batch(seed=0))
    after = masters(t)
    for n in t.trainable:  # lora_a gets no gradient while lora_b is 0
        assert not torch.equal(before[n], after[n]) or n.endswith("lora_a"), n
    assert all(torch.equal(p, base[n]) for n, p in frozen.items())
    for name, merged in t.export_weights(full=False):
        assert merged.dtype == BF16 and not torch.equal(merged, base[name]), name
    pure = TorchTrainer(bf16_dir, TrainConfig(lr=1e-3, lora_rank=4, precision="pure"))
    assert all(p.dtype == BF16 for p in pure.trainable.values())


# -- temperature ---------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_logprobs_are_of_the_tempered_distribution(fp32_dir, temperature):
    t = TorchTrainer(fp32_dir, TrainConfig(temperature=temperature))
    batch = make_batch(seed=5)
    got = t.logprobs(batch)
    want = reference_logp(load_qwen3(fp32_dir), batch, temperature)
    np.testing.assert_allclose(got, want, atol=2e-5)
    assert np.abs(got - reference_logp(load_qwen3(fp32_dir), batch, 1.0)).max() > 0.1
    # the loss's new log-probs and the KL reference's are tempered the same way: on-policy at step 0
    k = TorchTrainer(fp32_dir, TrainConfig(temperature=temperature, loss=LossConfig(beta=0.1)))
    batch.old_logp[:] = got
    m = k.train_step(batch)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["clip_frac"] == 0
    assert m["kl"] == pytest.approx(0.0, abs=1e-7)


def test_greedy_is_untempered(fp32_dir):
    t1, t07 = TorchTrainer(fp32_dir, TrainConfig()), TorchTrainer(fp32_dir, TrainConfig(temperature=0.7))
    assert t1.greedy(PROMPT, 6) == t07.greedy(PROMPT, 6)


@pytest.mark.parametrize("precision", ["mixed", "pure"])
def test_bf16_engine_sampling_at_temperature_is_on_policy(bf16_dir, precision):
    """A bf16 engine samples at T = 0.7 from the trainer's exported weights after a step: the
    trainer's log-probs are the engine's to bf16 rounding, and the next step's ratio is 1 to it.

    bf16 tolerance: the engine attends with SDPA over a left-padded prefill and one-token decodes
    on its KV cache, the trainer in one causal pass; torch's CPU flash kernel rounds a bf16 row
    differently for another key count (up to ~2% of an attention output, 0.02 nats of log-prob
    seen). The eager path (float32 scores) agreed to 1e-6; the float32 alignment stays tight
    (``test_trainer.py::test_logprobs_are_the_engines_sampling_logprobs``), and the run's default
    recomputes ``old_logp`` with the trainer (``LifecycleOptions.old_logp``)."""
    t = TorchTrainer(bf16_dir, TrainConfig(lr=1e-3, temperature=0.7, precision=precision))
    t.train_step(make_batch())
    engine = ManagedEngine(EmbeddedEngine(bf16_dir, device="cpu"))
    engine.update_weights(t.export_weights())
    assert compare_fingerprints(t.weights_fingerprint(), engine.weights_fingerprint()) == []
    prompts = [PROMPT, PROMPT[:3], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.7, seed=0))
    batch = build_batch(prompts, outs, np.ones(len(prompts), np.float32))
    mask = batch.loss_mask
    diff = np.abs(t.logprobs(batch)[mask] - batch.old_logp[mask])
    assert diff.max() < 0.05 and diff.mean() < 0.02, diff
    t.cfg = dataclasses.replace(t.cfg, temperature=1.0)  # the tolerance still tells the temperatures apart
    assert np.abs(t.logprobs(batch)[mask] - batch.old_logp[mask]).max() > 0.2
    t.cfg = dataclasses.replace(t.cfg, temperature=0.7)
    m = t.train_step(batch)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=0.02) and m["clip_frac"] == 0

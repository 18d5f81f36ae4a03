"""What the JAX trainer stores, computes and optimises in, and which distribution its log-probs are of.

- Mixed precision (the default): a bf16 checkpoint trains float32 master params with float32
  AdamW moments, computes in bf16, and gives the engine bf16 casts; at lr 1e-6 an Adam step
  (~lr) is below half a bf16 ulp of a typical weight, so with bf16 params (``precision="pure"``)
  almost nothing changes, while the masters change nearly everywhere. A save/restore keeps the
  masters exactly.
- Temperature: every log-prob the trainer computes is ``log_softmax(logits / T)`` (whole and
  chunked head), checked against a float64 reference from the untempered logits; the greedy
  probe stays untempered.
- LoRA on a bf16 checkpoint, on stacked layers (the TPU layout) and the other model paths:
  adapters in the trainable dtype, the frozen base in the checkpoint's, the branch in bf16.
- ``ModelOptions.resolved``, the one rule for all of this, and the memory plan that follows it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mllm_rl.backends.jax.export_layout import array_of, hf_layout
from mllm_rl.backends.jax.fingerprint import fingerprint
from mllm_rl.backends.jax.model import Linear, get_weight
from mllm_rl.backends.jax.options import ModelOptions
from mllm_rl.backends.jax.sharding import make_mesh
from mllm_rl.backends.jax.step_fns import abstract_state, make_run
from mllm_rl.backends.jax.trainer import JaxTrainer
from mllm_rl.checkpoint import ModelDir, make_checkpoint
from mllm_rl.presets import get_preset
from mllm_rl.trainer import OPTIMIZER, PARAMS, RolloutBatch, TrainConfig
from tests.conftest import run_cli

BF16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)
TINY = get_preset("tiny")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    """The tiny preset written in bf16 (as every Qwen3 checkpoint is)."""
    out = tmp_path_factory.mktemp("ckpt") / "tiny-bf16"
    return make_checkpoint(TINY, out, dtype="bfloat16", show_progress=False)


@pytest.fixture(scope="module")
def bf16_md(bf16_dir) -> ModelDir:
    return ModelDir.open(bf16_dir)


def every_token_batch(seed: int = 0) -> RolloutBatch:
    """4 rows of 96 positions holding each of the 384 vocabulary tokens once (every embedding
    row gets a gradient), non-zero advantages, old log-probs to be filled in."""
    rng = np.random.default_rng(seed)
    tokens = rng.permutation(TINY.vocab_size).reshape(4, -1).astype(np.int32)
    attn = np.ones(tokens.shape, bool)
    loss_mask = attn.copy()
    loss_mask[:, :8] = False
    adv = np.array([1.0, -1.0, 0.5, -0.5], np.float32)
    return RolloutBatch(tokens, attn, loss_mask, np.zeros(tokens.shape, np.float32), adv)


def on_policy(t: JaxTrainer, batch: RolloutBatch) -> RolloutBatch:
    """``batch`` with the trainer's own log-probs as the old ones (ratio 1: nothing clipped)."""
    old = np.where(batch.loss_mask, t.logprobs(batch), 0).astype(np.float32)
    return dataclasses.replace(batch, old_logp=old)


def host(tree) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(tree)]


def changed_fraction(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return sum(int((x != y).sum()) for x, y in zip(a, b, strict=True)) / sum(x.size for x in a)


# -- the resolution rule -------------------------------------------------------------------------


def test_resolved_dtypes_follow_precision_checkpoint_and_lora():
    r = ModelOptions().resolved
    mixed = r("bfloat16", "mixed")
    assert (mixed.params, mixed.compute, mixed.opt, mixed.export, mixed.trainable) == (
        "float32", "bfloat16", "float32", "bfloat16", "float32",
    )  # fmt: skip
    lora = r("bfloat16", "mixed", lora=True)  # the frozen base never trains: it stays bf16
    assert (lora.params, lora.adapters, lora.trainable, lora.opt, lora.compute) == (
        "bfloat16", "float32", "float32", "float32", "bfloat16",
    )  # fmt: skip
    for pure in (r("bfloat16", "pure"), r("bfloat16", "pure", lora=True)):
        assert {pure.params, pure.adapters, pure.compute, pure.opt, pure.export} == {"bfloat16"}
    for p in ("mixed", "pure"):  # a float32 checkpoint is float32 throughout
        f = r("float32", p, lora=True)
        assert {f.params, f.adapters, f.compute, f.opt, f.export} == {"float32"}
    # explicit dtypes still override (param_dtype sets every stored param, compute follows it)
    e = ModelOptions(param_dtype="bfloat16", opt_dtype="float32").resolved("float32", "mixed")
    assert (e.params, e.compute, e.opt, e.export) == ("bfloat16", "bfloat16", "float32", "float32")
    e = ModelOptions(compute_dtype="float32").resolved("bfloat16", "mixed")
    assert (e.params, e.compute, e.opt) == ("float32", "float32", "float32")
    with pytest.raises(ValueError, match="precision"):
        r("bfloat16", "half")


def test_abstract_state_a_plan_compiles_follows_the_same_rule():
    cfg = dataclasses.replace(TINY, torch_dtype="bfloat16")
    mesh = make_mesh(1, jax.devices()[:1])
    dtypes = lambda tree: {x.dtype for x in jax.tree.leaves(tree) if x.ndim}  # noqa: E731
    trainable, frozen, opt = abstract_state(cfg, TrainConfig(), ModelOptions(), mesh)
    assert dtypes(trainable) == dtypes(opt) == {F32} and not jax.tree.leaves(frozen)
    trainable, frozen, opt = abstract_state(
        cfg, TrainConfig(lora_rank=4), ModelOptions(scan_layers=False), mesh
    )
    assert dtypes(trainable) == dtypes(opt) == {F32} and dtypes(frozen) == {BF16}
    trainable, _, opt = abstract_state(cfg, TrainConfig(precision="pure"), ModelOptions(), mesh)
    assert dtypes(trainable) == dtypes(opt) == {BF16}


# -- mixed precision on a bf16 checkpoint ----------------------------------------------------------


@pytest.mark.slow  # compiles and trains the model
def test_bf16_checkpoint_trains_float32_masters_and_resumes_exactly(bf16_md, tmp_path):
    """Two steps at lr 1e-6: the masters are float32 and >= 90% of their elements move in the
    second step (with bf16 params a few percent do); the engine gets bf16 and the fingerprint
    hashes exactly that; a trainer restored from the checkpoint after step 1 (saved in the phase,
    or by orbax's asynchronous save written after step 2) takes a second step bit-equal to the
    original's."""
    cfg = TrainConfig(lr=1e-6, micro_batch_size=4)
    t = JaxTrainer(bf16_md, cfg, ModelOptions())
    assert t.export_dtype == BF16
    assert {x.dtype for x in jax.tree.leaves(t.trainable)} == {F32}
    assert {x.dtype for x in jax.tree.leaves(t.opt_state) if x.ndim} == {F32}  # AdamW moments
    batch = on_policy(t, every_token_batch())
    m = t.train_step(batch)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and np.isfinite(m["loss"])
    w1, o1 = host(t.trainable), host(t.opt_state)
    t.save(tmp_path)
    snap = t.snapshot(tmp_path / "async")  # orbax's asynchronous save, the same moment
    assert snap.nbytes == sum(x.nbytes for x in w1 + o1)
    t.train_step(batch)
    w2, o2 = host(t.trainable), host(t.opt_state)
    t.offload([PARAMS, OPTIMIZER])  # the arrays the save read are gone from the trainer
    t.onload([PARAMS, OPTIMIZER])
    snap.write(tmp_path / "async")  # written after the step: it holds step 1's state all the same
    assert changed_fraction(w1, w2) >= 0.9, changed_fraction(w1, w2)

    # what the engine gets: bf16 casts of the masters (kernels in our [in, out] layout); the
    # fingerprint hashes exactly those
    names, exported = zip(*((n, array_of(x)) for n, x in t.export_weights()),
                          strict=True)  # fmt: skip
    assert {x.dtype for x in exported} == {BF16}
    assert t.weights_fingerprint() == fingerprint(zip(names, exported, strict=True))
    masters = {n: np.asarray(get_weight(t._model_view(), n)[0]) for n in names}
    for n, x in zip(names, exported, strict=True):
        np.testing.assert_array_equal(np.asarray(x), masters[n].astype(BF16), err_msg=n)

    for saved in (tmp_path, tmp_path / "async"):
        r = JaxTrainer(bf16_md, cfg, ModelOptions())
        r.restore(saved)
        for got, want in zip(host(r.trainable) + host(r.opt_state), w1 + o1, strict=True):
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
        r.train_step(batch)
        for got, want in zip(host(r.trainable) + host(r.opt_state), w2 + o2, strict=True):
            np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # compiles and trains the model
def test_pure_precision_keeps_bf16_params_and_loses_steps_below_half_an_ulp(bf16_md):
    """What ``precision="pure"`` trades for half the state: at lr 1e-6 most bf16 weights do not move."""
    t = JaxTrainer(bf16_md, TrainConfig(lr=1e-6, micro_batch_size=4, precision="pure"), ModelOptions())
    assert {x.dtype for x in jax.tree.leaves(t.trainable)} == {BF16}
    assert {x.dtype for x in jax.tree.leaves(t.opt_state) if x.ndim} == {BF16}
    batch = on_policy(t, every_token_batch())
    t.train_step(batch)
    w1 = host(t.trainable)
    t.train_step(batch)
    assert changed_fraction(w1, host(t.trainable)) < 0.5


# -- temperature ------------------------------------------------------------------------------------


def _batch_with_padding() -> RolloutBatch:
    rng = np.random.default_rng(5)
    b, t = 3, 24
    tokens = rng.integers(0, TINY.vocab_size, (b, t)).astype(np.int32)
    attn = np.ones((b, t), bool)
    attn[0, 17:] = False
    tokens[~attn] = 0
    loss_mask = attn.copy()
    loss_mask[:, :5] = False
    return RolloutBatch(
        tokens, attn, loss_mask, np.zeros((b, t), np.float32), np.array([1.0, -0.5, 0.7], np.float32)
    )


def reference_logp(logits: np.ndarray, tokens: np.ndarray, temperature: float) -> np.ndarray:
    """[B, T] float64: log softmax(logits[:, t - 1] / T)[tokens[:, t]] for t >= 1, 0 at t = 0."""
    z = logits.astype(np.float64) / temperature
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    out = np.zeros(tokens.shape)
    out[:, 1:] = np.take_along_axis(logp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]
    return out


@pytest.mark.slow  # compiles and trains the model
# each temperature on one head: the whole logits, and 7-position chunks (7 does not divide T)
@pytest.mark.parametrize("temperature,chunk", [(0.7, 0), (1.3, 7)])
def test_logprobs_are_of_the_tempered_distribution(tiny_ckpt, temperature, chunk):
    md = ModelDir.open(tiny_ckpt)
    opts = ModelOptions(logprob_chunk=chunk)  # 7 does not divide T: a padded last chunk
    t = JaxTrainer(md, TrainConfig(micro_batch_size=4, temperature=temperature), opts)
    batch = _batch_with_padding()
    model = nnx.merge(t.graphdef, t.trainable, t.frozen)
    run = make_run(opts, t.mesh)
    tokens, attn = jnp.asarray(batch.tokens), jnp.asarray(batch.attention_mask)
    logits = np.asarray(nnx.jit(lambda m, x, a: m(x, a, run))(model, tokens, attn))  # untempered
    want = reference_logp(logits, batch.tokens, temperature)
    valid = batch.attention_mask & np.roll(batch.attention_mask, 1, axis=1)
    valid[:, 0] = False
    got = t.logprobs(batch)
    np.testing.assert_allclose(got[valid], want[valid], rtol=1e-5, atol=2e-5)
    assert np.abs(reference_logp(logits, batch.tokens, 1.0) - want)[valid].max() > 0.05  # T matters here
    # the greedy probe reads the untempered logits
    pos = 10
    probe = np.asarray(t.fns.next_logits(t.trainable, t.frozen, tokens, attn, jnp.int32(pos)))
    np.testing.assert_allclose(probe, logits[:, pos], rtol=1e-5, atol=1e-5)
    # the loss's new log-probs are the same: against tempered old log-probs step 0's ratio is 1
    m = t.train_step(
        dataclasses.replace(batch, old_logp=np.where(batch.loss_mask, want, 0).astype(np.float32))
    )
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-5)


# -- LoRA on a bf16 checkpoint, every model path --------------------------------------------------

LORA_PATHS = {
    "scan": ModelOptions(),  # the default: stacked layers, remat, the head in 256-position chunks
    "list": ModelOptions(scan_layers=False, remat="none", logprob_chunk=0),
    "scan_remat_dots": ModelOptions(remat="dots"),
    "remat_block_chunked_attention": ModelOptions(
        scan_layers=False, remat="block", attention="chunked", attention_chunk=16
    ),
    "tpu_default": ModelOptions.for_platform("tpu"),  # scan, remat, splash (Pallas interpreter), chunked head
}


def _lora_step(md: ModelDir, opts: ModelOptions, precision: str) -> JaxTrainer:
    t = JaxTrainer(md, TrainConfig(lr=1e-3, micro_batch_size=4, lora_rank=4, precision=precision), opts)
    batch = on_policy(t, every_token_batch())
    b0 = host(t.trainable)
    m = t.train_step(batch)
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]) and m["grad_norm"] > 0
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
    assert changed_fraction(b0, host(t.trainable)) > 0.5
    assert {x.dtype for x in jax.tree.leaves(t.frozen)} == {BF16}  # the base stays as stored
    names, exported = zip(*t.export_weights(full=False), strict=True)
    assert names and {hf_layout(x).dtype for x in exported} == {BF16}
    return t


@pytest.mark.slow  # compiles and trains the model
@pytest.mark.parametrize("path", list(LORA_PATHS))
def test_lora_on_a_bf16_checkpoint_trains_float32_adapters(bf16_md, path):
    t = _lora_step(bf16_md, LORA_PATHS[path], "mixed")
    assert {x.dtype for x in jax.tree.leaves(t.trainable)} == {F32}
    assert {x.dtype for x in jax.tree.leaves(t.opt_state) if x.ndim} == {F32}


def test_a_lora_branch_computes_in_the_dtype_of_its_base():
    """float32 adapters on a bf16 kernel: the output stays bf16 (a float32 branch would promote
    it and break a scan's bf16 carry)."""
    lin = Linear(8, 16, BF16)
    lin.add_lora(2, 4.0, jax.random.key(0), F32)
    assert lin.lora_a.dtype == lin.lora_b.dtype == F32
    lin.lora_b.set_value(jnp.full((2, 16), 0.5, F32))
    x = jnp.ones((3, 8), BF16)
    y = lin(x)
    assert y.dtype == BF16
    want = (
        x.astype(F32) @ lin.kernel[...].astype(F32)
        + (x.astype(F32) @ lin.lora_a[...] @ lin.lora_b[...]) * 2.0
    )
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2)


@pytest.mark.slow  # compiles and trains the model
def test_lora_on_a_bf16_checkpoint_pure_precision(bf16_md):
    t = _lora_step(bf16_md, ModelOptions(), "pure")
    assert {x.dtype for x in jax.tree.leaves(t.trainable)} == {BF16}


# -- the memory plan follows the same default -----------------------------------------------------


@pytest.mark.slow  # compiles and trains the model
@pytest.mark.parametrize("precision,itemsize", [("mixed", 4), ("pure", 2)])
def test_cpu_plan_of_a_bf16_checkpoint_counts_the_precisions_params(bf16_dir, tmp_path, precision, itemsize):
    """The plan's ``--precision`` is the run's: float32 masters and moments under mixed, bf16 under pure."""
    out = tmp_path / "plan"
    r = run_cli("mllm_rl.memplan", "--backend", "jax", "--model", str(bf16_dir), "--target", "cpu",
                "--kv-tokens", "1024", "--micro-batch-size", "2", "--seq-len", "32", "--precision", precision,
                "--out", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    comps = json.loads((out / "plan.json").read_text())["plans"]["multi_stage"]["components"]
    n = sum(int(np.prod(s)) for s in TINY.param_shapes().values())
    assert comps["engine_weights"]["bytes_per_device"] == 2 * n  # the engine holds bf16
    assert comps["trainer_params"]["bytes_per_device"] == itemsize * n
    assert 2 * itemsize * n <= comps["optimizer"]["bytes_per_device"] < 2 * itemsize * n + 1024  # two moments

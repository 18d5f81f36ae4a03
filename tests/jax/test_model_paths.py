"""Every ``ModelOptions`` path of the JAX model against the reference path, on CPU, fp32.

The reference is ``REFERENCE``: layers in a Python loop, no remat, dense attention with the
[B, N, T, T] scores, whole [B, T, V] logits (not the default: ``ModelOptions()`` stacks the
layers under scan and chunks the head). Each other path (stacked layers under scan, remat,
chunked / XLA / splash attention, chunked head, the defaults) must give the same logits, log-probs,
loss and gradients (by HF parameter name) within float32 tolerance on a batch with padding
and an all-padding row; the trainer built on a path must train, export, fingerprint, probe
and checkpoint like the reference. Splash attention runs in Pallas interpret mode here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mllm_rl.backends.jax.attention import attention
from mllm_rl.backends.jax.export_layout import hf_layout
from mllm_rl.backends.jax.model import get_weight, linear_layers
from mllm_rl.backends.jax.options import ModelOptions
from mllm_rl.backends.jax.sharding import make_mesh, param_spec
from mllm_rl.backends.jax.step_fns import abstract_state, load_state, make_run, make_step_fns
from mllm_rl.backends.jax.trainer import JaxTrainer
from mllm_rl.checkpoint import ModelDir
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.trainer import RolloutBatch, TrainConfig
from tests.conftest import ROOT, XLA_TEST_FLAGS

# Each test compiles several model paths (splash attention runs in Pallas interpret mode on CPU):
# minutes on 2 cores, so the whole file is in the slow set; make test runs it.
pytestmark = pytest.mark.slow

TOL = {"rtol": 1e-4, "atol": 2e-5}
REFERENCE = ModelOptions(scan_layers=False, remat="none", attention="dense", logprob_chunk=0)


def _ref(**kw) -> ModelOptions:
    """The reference with ``kw`` changed: one option at a time."""
    return dataclasses.replace(REFERENCE, **kw)


# Each path compiles a forward, log-probs and gradients (15-30 s on 2 cores), so an option is
# covered inside the combination a run uses rather than also alone: the defaults hold scan and
# per-block remat, the chunked head's 16 does not divide T (the padded chunk), the TPU default holds
# splash (also checked alone against dense in test_attention_paths_agree_...).
PATHS = {
    "scan_remat_dots": _ref(scan_layers=True, remat="dots"),
    "attention_xla": _ref(attention="xla"),
    "attention_chunked": _ref(attention="chunked", attention_chunk=16),
    "default": ModelOptions.for_platform("cpu"),  # what a CPU run trains on: scan, remat per block
    "default_chunked_head": dataclasses.replace(ModelOptions.for_platform("cpu"), logprob_chunk=16),
    "tpu_default": ModelOptions.for_platform("tpu"),  # all of them together, splash attention
}
# kl_clamp 0: the batch's random ref_logp puts k3 far past verl's clamp of 10, where it would stop
# the KL term's gradient; unclamped, every weight gets a gradient the paths must agree on.
TRAIN = TrainConfig(lr=1e-2, micro_batch_size=2, mini_batches=2, loss=LossConfig(beta=0.05, kl_clamp=0.0))


@pytest.fixture(scope="module")
def md(tiny_ckpt) -> ModelDir:
    return ModelDir.open(tiny_ckpt)


@pytest.fixture(scope="module")
def mb() -> dict[str, jax.Array]:
    """4 rows of 40 positions: full, right-padded, left-padded, all padding."""
    rng = np.random.default_rng(0)
    b, t = 4, 40
    attn = np.ones((b, t), bool)
    attn[1, 29:] = False
    attn[2, :5] = False
    attn[3] = False
    loss_mask = attn.copy()
    loss_mask[:, :9] = False
    host = {
        "tokens": rng.integers(0, 384, (b, t)).astype(np.int32),
        "attn": attn,
        "loss_mask": loss_mask,
        "old_logp": np.where(loss_mask, -rng.random((b, t)), 0).astype(np.float32),
        "is_weight": np.ones((b, t), np.float32),
        "adv": rng.normal(size=b).astype(np.float32),
        "ref_logp": np.where(loss_mask, -rng.random((b, t)), 0).astype(np.float32),
    }
    return {k: jnp.asarray(v) for k, v in host.items()}


def observe(
    md: ModelDir,
    opts: ModelOptions,
    mb: dict[str, jax.Array],
    cfg: TrainConfig = TRAIN,
    logits: bool = True,
    grads: bool = True,
) -> dict:
    """Logits, log-probs, loss, metric sums and gradients (by HF name) of one path; ``logits`` /
    ``grads`` False: a test that reads only the other part compiles only its functions."""
    mesh = make_mesh(opts.tp, jax.devices()[:1])
    fns = make_step_fns(md.config, cfg, opts, mesh)
    _, trainable, frozen = load_state(md, cfg, opts, mesh)
    out: dict = {}
    if logits:
        model = nnx.merge(fns.graphdef, trainable, frozen)
        out["logits"] = np.asarray(
            nnx.jit(lambda m, x, a: m(x, a, make_run(opts, mesh)))(model, mb["tokens"], mb["attn"])
        )
    if not grads:
        return out
    logp = fns.logprob(trainable, frozen, mb["tokens"], mb["attn"])
    (loss, sums), g_state = fns.grad(trainable, frozen, mb, jnp.float32(50.0), jnp.float32(4.0))
    gmodel = nnx.merge(fns.graphdef, g_state, frozen)
    if cfg.lora_rank:
        g = {
            n: (np.asarray(lin.lora_a[...]), np.asarray(lin.lora_b[...]))
            for n, lin in linear_layers(gmodel).items()
        }
    else:
        g = {n: np.asarray(get_weight(gmodel, n)[0]) for n in md.tensors}
    return {**out, "logp": np.asarray(logp), "loss": float(loss),
            "sums": {k: float(v) for k, v in sums.items()}, "grads": g}  # fmt: skip


@pytest.fixture(scope="module")
def reference(md, mb) -> dict:
    return observe(md, REFERENCE, mb)


def assert_same(got: dict, want: dict, mb: dict[str, jax.Array]) -> None:
    valid = np.asarray(mb["attn"])
    np.testing.assert_allclose(got["logits"][valid], want["logits"][valid], **TOL)
    assert np.isfinite(got["logits"]).all()  # padding rows: garbage, never NaN
    v = valid[:, 1:] & valid[:, :-1]
    np.testing.assert_allclose(got["logp"][v], want["logp"][v], **TOL)
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
    for k, x in want["sums"].items():
        assert got["sums"][k] == pytest.approx(x, rel=1e-4, abs=1e-5), k
    assert got["grads"].keys() == want["grads"].keys()
    for name, g in want["grads"].items():
        scale = float(np.abs(g).max()) if np.size(g) else 1.0
        np.testing.assert_allclose(got["grads"][name], g, rtol=1e-3, atol=1e-4 * scale + 1e-7, err_msg=name)


@pytest.mark.parametrize("path", list(PATHS))
def test_path_matches_the_reference(md, mb, reference, path):
    assert_same(observe(md, PATHS[path], mb), reference, mb)


def test_reference_gradients_are_not_trivial(reference):
    """The comparison above means something: every weight gets a non-zero gradient."""
    assert all(np.abs(g).max() > 0 for g in reference["grads"].values())
    assert reference["loss"] != 0


def test_lora_on_stacked_layers_matches_the_list_layout(md, mb):
    """Same adapters drawn per layer (by HF name) and same adapter gradients."""
    cfg = TrainConfig(lora_rank=4, loss=LossConfig(beta=0.05, kl_clamp=0.0))
    want = observe(md, REFERENCE, mb, cfg, logits=False)
    got = observe(md, _ref(scan_layers=True, remat="block", logprob_chunk=16), mb, cfg, logits=False)
    np.testing.assert_allclose(got["logp"][np.asarray(mb["attn"])[:, 1:]],
                               want["logp"][np.asarray(mb["attn"])[:, 1:]], **TOL)  # fmt: skip
    for name, (ga, gb) in want["grads"].items():
        np.testing.assert_allclose(got["grads"][name][0], ga, rtol=1e-3, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(got["grads"][name][1], gb, rtol=1e-3, atol=1e-6, err_msg=name)
    assert max(np.abs(gb).max() for _, gb in want["grads"].values()) > 0


def test_attention_paths_agree_on_gqa_with_padding_and_odd_length():
    """All four implementations on random grouped-query inputs, T not a multiple of any block."""
    rng = np.random.default_rng(1)
    b, t, n, k, d = 2, 77, 6, 2, 64
    q, kk, v = (jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32) for h in (n, k, k))
    attn = np.ones((b, t), bool)
    attn[0, :9] = False  # left padding: a real query must not see these keys
    attn[1, 50:] = False
    ref = attention(q, kk, v, jnp.asarray(attn), "dense")
    interp = make_run(_ref(attention="splash"), make_mesh(1, jax.devices()[:1])).interpret
    for impl, kw in (("xla", {}), ("chunked", {"chunk": 32}), ("splash", {"interpret": interp})):
        out = attention(q, kk, v, jnp.asarray(attn), impl, **kw)
        np.testing.assert_allclose(
            np.asarray(out)[attn], np.asarray(ref)[attn], rtol=1e-5, atol=1e-5, err_msg=impl
        )


def _batch(seed: int = 3, b: int = 4, t: int = 24) -> RolloutBatch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 384, (b, t)).astype(np.int32)
    attn = np.ones((b, t), bool)
    attn[0, 18:] = False
    tokens[~attn] = 0
    loss_mask = attn.copy()
    loss_mask[:, :6] = False
    old = np.where(loss_mask, -rng.random((b, t)) - 5.0, 0).astype(np.float32)
    return RolloutBatch(tokens, attn, loss_mask, old, rng.normal(size=b).astype(np.float32))


@pytest.mark.parametrize("lora", [0, 4])
def test_trainer_on_the_tpu_paths_trains_exports_and_checkpoints_like_the_reference(md, tmp_path, lora):
    """Two RL steps (KL in the loss, 2 mini-batches of 2 micro-batches), then export, fingerprint,
    greedy probe, log-probs and an orbax save/restore round trip, stacked vs list layout."""
    cfg = TrainConfig(
        lr=1e-2, micro_batch_size=1, mini_batches=2, lora_rank=lora, loss=LossConfig(beta=0.05, kl_clamp=0.0)
    )
    ref, new = JaxTrainer(md, cfg, REFERENCE), JaxTrainer(md, cfg, ModelOptions.for_platform("tpu"))
    assert new.opts.scan_layers and new.opts.attention == "splash"
    batch = _batch()
    for (na, xa), (nb, xb) in zip(
        ref.export_weights(), new.export_weights(), strict=True
    ):  # as loaded: bit-equal
        xa, xb = hf_layout(xa), hf_layout(xb)
        assert na == nb and xa.shape == xb.shape == tuple(md.tensors[na][1].shape) and xa.dtype == xb.dtype
        np.testing.assert_array_equal(np.asarray(xb), np.asarray(xa), err_msg=na)
    np.testing.assert_allclose(new.logprobs(batch), ref.logprobs(batch), **TOL)
    (toks_a, margins_a), (toks_b, margins_b) = ref.greedy([1, 2, 3, 4], 6), new.greedy([1, 2, 3, 4], 6)
    assert toks_b == toks_a and margins_b == pytest.approx(margins_a, abs=1e-4)
    for _ in range(2):
        a, b = ref.train_step(batch), new.train_step(batch)
        for k, x in a.items():
            if k != "train_s":
                assert b[k] == pytest.approx(x, rel=1e-3, abs=1e-5), k
    # After two AdamW steps at lr 1e-2 float32 noise in near-zero gradients is amplified (Adam
    # normalises it), hence the looser tolerances below.
    np.testing.assert_allclose(new.logprobs(batch), ref.logprobs(batch), rtol=1e-3, atol=2e-3)
    fa, fb = ref.weights_fingerprint(), new.weights_fingerprint()
    assert fa.keys() == fb.keys() == set(md.tensors)
    for name, (s, q) in fa.items():
        assert fb[name][1] == pytest.approx(q, rel=1e-4), name
        assert fb[name][0] == pytest.approx(s, rel=1e-3, abs=1e-3 * q**0.5), name
    exp_a, exp_b = ref.export_weights(full=False), new.export_weights(full=False)
    assert exp_a.names == exp_b.names == (ref.linear_names if lora else list(md.tensors))
    for (na, xa), (_, xb) in zip(exp_a, exp_b, strict=True):  # what the engine gets: LoRA merged, HF layout
        xa, xb = hf_layout(xa), hf_layout(xb)
        assert xb.shape == xa.shape and xb.dtype == xa.dtype, na
        assert float(jnp.sum(xb.astype(jnp.float32) ** 2)) == pytest.approx(fb[na][1], rel=1e-5), na
    new.save(tmp_path)
    before = new.weights_fingerprint()
    new.train_step(batch)
    assert new.weights_fingerprint() != before
    new.restore(tmp_path)
    assert new.weights_fingerprint() == before


def test_a_checkpoint_restores_only_into_the_layout_it_was_written_from(md, tmp_path):
    """The loop layout's orbax state into the default (stacked) trainer: one ``ValueError`` naming
    the option, not orbax's tree diff; the same layout restores."""
    cfg = TrainConfig()
    JaxTrainer(md, cfg, REFERENCE).save(tmp_path)
    with pytest.raises(ValueError, match=r"laid out unlike this trainer's \(scan_layers=True") as e:
        JaxTrainer(md, cfg, ModelOptions()).restore(tmp_path)
    assert "--model-option scan_layers" in str(e.value) and "Source: MISSING" not in str(e.value)
    JaxTrainer(md, cfg, REFERENCE).restore(tmp_path)


def test_stacked_layers_load_every_tensor_into_its_row(md):
    mesh = make_mesh(1, jax.devices()[:1])
    cfg = TrainConfig()
    fns = make_step_fns(md.config, cfg, ModelOptions(), mesh)
    _, trainable, frozen = load_state(md, cfg, ModelOptions(), mesh)
    model = nnx.merge(fns.graphdef, trainable, frozen)
    assert model.layers.mlp.up_proj.kernel.shape == (2, 128, 384)  # [L, in, out]
    for name, arr in md.iter_tensors():
        value, transpose = get_weight(model, name)
        np.testing.assert_array_equal(
            np.asarray(value.T if transpose else value), np.asarray(arr), err_msg=name
        )


def test_dtype_options(md, mb, reference):
    """bf16 params with float32 AdamW moments; float32 params computed in bf16 (bf16 tolerance)."""
    mesh = make_mesh(1, jax.devices()[:1])
    opts = _ref(param_dtype="bfloat16", opt_dtype="float32")
    _, _, opt_state = abstract_state(md.config, TRAIN, opts, mesh)
    trainable, _, _ = abstract_state(md.config, TRAIN, opts, mesh)
    assert {x.dtype for x in jax.tree.leaves(trainable)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(opt_state) if x.ndim} == {jnp.dtype(jnp.float32)}
    t = JaxTrainer(md, TrainConfig(lr=1e-3), opts)
    m = t.train_step(_batch())
    assert np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"])
    names, arrays = zip(*t.export_weights(), strict=True)
    assert {hf_layout(a).dtype for a in arrays} == {jnp.dtype(jnp.float32)}  # the engine's (checkpoint) dtype
    got = observe(md, _ref(compute_dtype="bfloat16"), mb, grads=False)
    valid = np.asarray(mb["attn"])
    np.testing.assert_allclose(got["logits"][valid], reference["logits"][valid], atol=0.1)
    assert not np.array_equal(got["logits"][valid], reference["logits"][valid])  # it did compute in bf16


def test_sharding_rules_by_parameter_name():
    mesh = jax.sharding.AbstractMesh((2, 2), ("fsdp", "tp"))
    path = lambda *keys: tuple(jax.tree_util.DictKey(k) for k in keys)  # noqa: E731
    P = jax.sharding.PartitionSpec
    assert param_spec(path("layers", 0, "self_attn", "q_proj", "kernel"), (128, 512), mesh) == P("fsdp", "tp")
    assert param_spec(path("layers", 0, "self_attn", "o_proj", "kernel"), (512, 128), mesh) == P("tp", "fsdp")
    assert param_spec(path("layers", "mlp", "down_proj", "kernel"), (28, 384, 128), mesh) == P(
        None, "tp", "fsdp"
    )
    assert param_spec(path("layers", "mlp", "up_proj", "lora_a"), (28, 128, 4), mesh) == P(None, "fsdp", None)
    assert param_spec(path("layers", "mlp", "up_proj", "lora_b"), (28, 4, 384), mesh) == P(None, None, "tp")
    assert param_spec(path("embed_tokens"), (384, 128), mesh) == P("fsdp", "tp")
    assert param_spec(path("lm_head"), (383, 128), mesh) == P(None, "tp")  # 383 % 2: not split
    assert param_spec(path("norm", "weight"), (128,), mesh) == P()
    assert param_spec(path("layers", "input_layernorm", "weight"), (28, 128), mesh) == P()  # stacked norm
    # optimizer state: the same names under optax's containers
    assert param_spec(path("mu", "layers", 0, "mlp", "gate_proj", "kernel"), (128, 384), mesh) == P(
        "fsdp", "tp"
    )


_MESH_RUN = r"""
import json, sys
import numpy as np
from mllm_rl.backends.jax.options import ModelOptions
from mllm_rl.backends.jax.trainer import JaxTrainer
from mllm_rl.checkpoint import ModelDir
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.trainer import RolloutBatch, TrainConfig
d = np.load(sys.argv[2])
batch = RolloutBatch(*(d[k] for k in ("tokens", "attention_mask", "loss_mask", "old_logp", "advantages")))
out = {}
ref = ModelOptions(scan_layers=False, remat="none", logprob_chunk=0)
for name, opts in (("ref", ref), ("tp2", ModelOptions(tp=2, attention="splash", logprob_chunk=8))):
    t = JaxTrainer(ModelDir.open(sys.argv[1]), TrainConfig(lr=1e-2, micro_batch_size=4, loss=LossConfig(beta=0.05, kl_clamp=0.0)),
                   opts)
    specs = sorted({str(x.sharding.spec) for x in __import__("jax").tree.leaves(t.trainable)})
    out[name] = {"mesh": dict(t.mesh.shape), "specs": specs,
                 "metrics": [{k: v for k, v in t.train_step(batch).items() if k != "train_s"} for _ in range(2)],
                 "fingerprint": t.weights_fingerprint()}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
def test_fsdp_by_tp_mesh_on_four_devices_matches_one_device(md, tmp_path):
    """A (2 fsdp x 2 tp) mesh of 4 CPU devices, splash attention sharded by shard_map, vs the
    reference on the same 4 devices as plain FSDP."""
    batch = _batch(b=4)
    data = tmp_path / "batch.npz"
    np.savez(data, tokens=batch.tokens, attention_mask=batch.attention_mask, loss_mask=batch.loss_mask,
             old_logp=batch.old_logp, advantages=batch.advantages)  # fmt: skip
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"{XLA_TEST_FLAGS} --xla_force_host_platform_device_count=4",
    }
    r = subprocess.run([sys.executable, "-c", _MESH_RUN, str(md.path), str(data)], capture_output=True, text=True,
                       timeout=900, env=env, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    assert out["ref"]["mesh"] == {"fsdp": 4, "tp": 1} and out["tp2"]["mesh"] == {"fsdp": 2, "tp": 2}
    assert "P(None, 'fsdp', 'tp')" in out["tp2"]["specs"]  # stacked column-parallel kernels
    for a, b in zip(out["ref"]["metrics"], out["tp2"]["metrics"], strict=True):
        for k, x in a.items():
            assert b[k] == pytest.approx(x, rel=1e-3, abs=1e-5), k
    for name, (s, q) in out["ref"]["fingerprint"].items():
        assert out["tp2"]["fingerprint"][name][1] == pytest.approx(q, rel=1e-4), name
        assert out["tp2"]["fingerprint"][name][0] == pytest.approx(s, rel=1e-3, abs=1e-3 * q**0.5), name

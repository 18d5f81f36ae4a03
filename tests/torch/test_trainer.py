"""The torch trainer (``backends/torch/trainer.py``): training, LoRA, offload/onload, checkpoints,
weight export into the real embedded engine, the garbage guard's greedy reference."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess

import numpy as np
import pytest
import torch

from mllm_rl.backends.torch.engine import EmbeddedEngine
from mllm_rl.backends.torch.model import greedy_decode, load_qwen3
from mllm_rl.backends.torch.probe import tracked_cpu_bytes
from mllm_rl.backends.torch.trainer import TorchTrainer, TrainerStateError
from mllm_rl.checkpoint import ModelDir
from mllm_rl.engine import SamplingParams, WeightExport, compare_fingerprints
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.rl.batch import build_batch
from mllm_rl.rl.loss_config import AGGREGATIONS, LossConfig
from mllm_rl.trainer import OPTIMIZER, PARAMS, TRAIN_METRICS, RolloutBatch, TrainConfig
from tests.conftest import ROOT
from tests.torch.conftest import needs_cuda

METRICS = set(TRAIN_METRICS)
PROMPT = [51, 71, 68, 220, 66, 64, 79]
JAX_PYTHON = ROOT / ".venv-jax" / "bin" / "python"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_ckpt) -> ModelDir:
    return ModelDir.open(tiny_ckpt)


def make_batch(b: int = 6, seed: int = 0) -> RolloutBatch:
    """``b`` rows of [prompt (3..6) | completion (1..5) | pad], random tokens, old log-probs
    around the tiny model's (~ -6) so that some ratios clip."""
    rng = np.random.default_rng(seed)
    p = rng.integers(3, 7, b)
    c = rng.integers(1, 6, b)
    t = int((p + c).max())
    tokens = np.zeros((b, t), np.int32)
    attn = np.zeros((b, t), bool)
    loss_mask = np.zeros((b, t), bool)
    old = np.zeros((b, t), np.float32)
    for i in range(b):
        n = p[i] + c[i]
        tokens[i, :n] = rng.integers(1, 300, n)
        attn[i, :n] = True
        loss_mask[i, p[i] : n] = True
        old[i, p[i] : n] = rng.normal(-5.9, 0.3, c[i])
    adv = rng.normal(0, 1, b).astype(np.float32)
    return RolloutBatch(tokens, attn, loss_mask, old, adv)


def trainer(model_dir: ModelDir, **kw) -> TorchTrainer:
    return TorchTrainer(model_dir, TrainConfig(**{"lr": 1e-2, **kw}))


def params(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.model.named_parameters()}


def opt_state(t: TorchTrainer) -> list[torch.Tensor]:
    return [v.clone() for st in t.optimizer.state.values() for v in st.values()]


def capture_grads(t: TorchTrainer) -> list[list[torch.Tensor]]:
    """Record the trainable gradients each time the optimizer steps (clipping already applied)."""
    seen: list[list[torch.Tensor]] = []
    step = t.optimizer.step

    def capturing_step() -> None:
        seen.append([p.grad.clone() for p in t.trainable.values()])
        step()

    t.optimizer.step = capturing_step  # type: ignore[method-assign]
    return seen


def assert_same(
    a: dict[str, torch.Tensor] | list[torch.Tensor], b: dict[str, torch.Tensor] | list[torch.Tensor]
):
    pairs = zip(a.values(), b.values(), strict=True) if isinstance(a, dict) else zip(a, b, strict=True)
    for x, y in pairs:
        assert torch.equal(x, y)


# -- training ------------------------------------------------------------------------
def test_full_step_changes_every_weight_and_reports_the_jax_metrics(model_dir):
    t = trainer(model_dir)
    before, batch = params(t), make_batch()
    m = t.train_step(batch)
    assert set(m) == METRICS
    assert m["tokens"] == int(batch.loss_mask.sum()) and m["updates"] == 1 and t.step == 1
    assert 0 < m["clip_frac"] < 1 and m["grad_norm"] > 0 and m["kl"] == 0
    assert 3 < m["neg_logp_mean"] < 9  # about log(384) for a random tiny model
    after = params(t)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged
    assert all(p.grad is None for p in t.model.parameters())  # no gradient memory left behind


def test_lora_steps_change_every_adapter_and_nothing_else(model_dir):
    t = trainer(model_dir, lora_rank=4)
    ref = load_qwen3(model_dir)
    assert t.greedy(PROMPT, 6)[0] == greedy_decode(ref, PROMPT, 6)[0]  # lora_b = 0: the base model
    before = params(t)
    assert set(t.trainable) == {n for n in before if n.endswith(("lora_a", "lora_b"))}
    assert len(t.trainable) == 2 * len(t.linear_names) == 2 * 7 * 2
    for _ in range(2):  # lora_a gets a gradient once lora_b is no longer 0
        t.train_step(make_batch())
    after = params(t)
    for n in before:
        changed = not torch.equal(before[n], after[n])
        assert changed == (n in t.trainable), n
    part = t.export_weights(full=False)
    assert not part.full and part.names == t.linear_names
    for name, merged in part:
        assert not torch.equal(merged, before[name]), name  # the adapters reach the engine
    full = t.export_weights(full=True)
    assert full.full and full.names == list(model_dir.tensors)


def test_lora_with_kl_uses_the_base_as_reference(model_dir):
    t = trainer(model_dir, lora_rank=4, loss=LossConfig(beta=0.1))
    assert t.ref_host is None  # no copy of the base: adapters off is the reference
    assert t.train_step(make_batch())["kl"] == 0
    assert t.train_step(make_batch(seed=1))["kl"] > 0


def test_full_fine_tune_kl_reference_is_the_initial_policy(model_dir):
    t = trainer(model_dir, loss=LossConfig(beta=0.1))
    assert t.train_step(make_batch())["kl"] == pytest.approx(0, abs=1e-7)
    assert t.train_step(make_batch(seed=1))["kl"] > 1e-6
    t.offload([PARAMS, OPTIMIZER])  # the reference is a host copy: not device memory
    assert t.state_bytes() == {PARAMS: 0, OPTIMIZER: 0}


@pytest.mark.parametrize("agg", AGGREGATIONS)
def test_gradient_accumulation_over_micro_batches_equals_one_big_batch(model_dir, agg):
    loss = LossConfig(aggregation=agg, beta=0.05, max_len=5)
    batch = make_batch(b=5, seed=3)
    results = []
    for micro in (5, 2):  # one micro-batch of 5 rows; micro-batches of 2, 2, 1 rows
        t = trainer(model_dir, micro_batch_size=micro, loss=loss, grad_clip=0.0)
        grads = capture_grads(t)
        results.append((t.train_step(batch), grads[0]))
    (m1, g1), (m2, g2) = results
    for k in ("loss", "grad_norm", "clip_frac", "kl", "ratio_mean", "neg_logp_mean"):
        assert m2[k] == pytest.approx(m1[k], rel=1e-5, abs=1e-7), k
    assert m1["tokens"] == m2["tokens"]
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def with_aborted_row(batch: RolloutBatch) -> RolloutBatch:
    """``batch`` and one more row: row 0's tokens, aborted (no loss token, advantage 0)."""
    return RolloutBatch(
        np.concatenate([batch.tokens, batch.tokens[:1]]),
        np.concatenate([batch.attention_mask, batch.attention_mask[:1]]),
        np.concatenate([batch.loss_mask, np.zeros_like(batch.loss_mask[:1])]),
        np.concatenate([batch.old_logp, np.zeros_like(batch.old_logp[:1])]),
        np.append(batch.advantages, np.float32(0.0)),
    )


@pytest.mark.parametrize("empty,scale", [("exclude", 1.0), ("count", 5 / 6)])
def test_an_aborted_completion_counts_in_the_sequence_mean_as_the_option_says(model_dir, empty, scale):
    """The trainer's sequence count (``seq_count``) follows ``--loss-empty-seqs``: an aborted
    completion leaves the loss of 5 completions as it was (verl) or scales it by 5/6 (TRL)."""
    loss = LossConfig(aggregation="seq_mean_token_mean", empty_seqs=empty)
    batch = make_batch(b=5, seed=3)
    plain = trainer(model_dir, micro_batch_size=2, loss=loss).train_step(batch)["loss"]
    aborted = trainer(model_dir, micro_batch_size=2, loss=loss).train_step(with_aborted_row(batch))["loss"]
    assert aborted == pytest.approx(plain * scale, rel=1e-5)


def test_mini_batches_are_separate_updates(model_dir):
    batch = make_batch(b=6)
    one = trainer(model_dir, grad_clip=0.0)
    two = trainer(model_dir, grad_clip=0.0, mini_batches=2)
    m1, m2 = one.train_step(batch), two.train_step(batch)
    assert (m1["updates"], m2["updates"]) == (1, 2) and m1["tokens"] == m2["tokens"]
    assert not torch.equal(params(one)["lm_head.weight"], params(two)["lm_head.weight"])
    tiny = trainer(model_dir, mini_batches=2)
    assert tiny.train_step(make_batch(b=1))["updates"] == 1  # an empty part is skipped


def test_grad_clip_bounds_the_update(model_dir):
    batch = make_batch()
    m = trainer(model_dir, grad_clip=0.0).train_step(batch)
    clipped = trainer(model_dir, grad_clip=m["grad_norm"] / 10, lr=0.0)
    grads = capture_grads(clipped)
    mc = clipped.train_step(batch)
    assert mc["grad_norm"] == pytest.approx(m["grad_norm"], rel=1e-5)  # the pre-clip norm is reported
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads[0]]))
    assert float(norm) == pytest.approx(m["grad_norm"] / 10, rel=1e-5)


# -- residency -----------------------------------------------------------------------
def test_offload_onload_round_trip_is_bit_exact_and_the_probe_sees_the_bytes(model_dir):
    t, twin = trainer(model_dir), trainer(model_dir)
    batch = make_batch()
    t.train_step(batch)
    twin.train_step(batch)
    p0, o0 = params(t), opt_state(t)
    held = t.state_bytes()
    assert held[PARAMS] == sum(p.numel() * 4 for p in t.model.parameters())
    assert held[OPTIMIZER] == 2 * held[PARAMS] + 4 * len(t.trainable)  # exp_avg, exp_avg_sq, step
    live0 = tracked_cpu_bytes()[0]
    assert t.offload([PARAMS]) == held[PARAMS]
    assert live0 - tracked_cpu_bytes()[0] == held[PARAMS]
    assert t.resident() == {PARAMS: False, OPTIMIZER: True} and t.state_bytes()[PARAMS] == 0
    assert t.offload([OPTIMIZER, PARAMS]) == held[OPTIMIZER]  # params: already offloaded, 0 more
    assert live0 - tracked_cpu_bytes()[0] == held[PARAMS] + held[OPTIMIZER]
    assert t.state_bytes() == {PARAMS: 0, OPTIMIZER: 0}
    assert t.onload([PARAMS, OPTIMIZER]) == held[PARAMS] + held[OPTIMIZER]
    assert tracked_cpu_bytes()[0] == live0
    assert t.resident() == {PARAMS: True, OPTIMIZER: True} and t.state_bytes() == held
    assert_same(params(t), p0)
    assert_same(opt_state(t), o0)
    assert t.onload([PARAMS]) == held[PARAMS]  # resident already: a no-op that reports what is held
    # the optimizer state that came back drives the next update exactly like the twin's own
    t.train_step(make_batch(seed=1))
    twin.train_step(make_batch(seed=1))
    assert_same(params(t), params(twin))


def test_training_exporting_or_saving_while_offloaded_is_refused(model_dir, tmp_path):
    t = trainer(model_dir)
    t.offload([PARAMS])
    for call in (lambda: t.train_step(make_batch()), lambda: t.export_weights(), lambda: t.greedy(PROMPT, 2),
                 lambda: t.weights_fingerprint(), lambda: t.logprobs(make_batch())):  # fmt: skip
        with pytest.raises(TrainerStateError, match="trainer params offloaded; onload first"):
            call()
    t.onload([PARAMS])
    t.offload([OPTIMIZER])
    with pytest.raises(TrainerStateError, match="trainer optimizer offloaded"):
        t.train_step(make_batch())
    with pytest.raises(TrainerStateError, match="optimizer offloaded"):
        t.save(tmp_path)
    with pytest.raises(ValueError, match="unknown trainer state"):
        t.offload(["grads"])
    with pytest.raises(ValueError, match="list of names"):
        t.onload(PARAMS)


def test_cuda_offload_frees_device_memory_and_round_trips(model_dir):
    needs_cuda()
    t = TorchTrainer(model_dir, TrainConfig(lr=1e-2), device="cuda")
    batch = make_batch()
    t.train_step(batch)
    p0, o0 = params(t), opt_state(t)
    torch.cuda.synchronize()
    a0 = torch.cuda.memory_allocated()
    held = t.state_bytes()
    assert held[PARAMS] > 0 and held[OPTIMIZER] == 2 * held[PARAMS]  # AdamW's step counters stay on the host
    assert t.offload([PARAMS, OPTIMIZER]) == held[PARAMS] + held[OPTIMIZER]
    assert a0 - torch.cuda.memory_allocated() >= held[PARAMS] + held[OPTIMIZER]
    assert t.state_bytes() == {PARAMS: 0, OPTIMIZER: 0}
    torch.cuda.empty_cache()
    assert t.onload([PARAMS, OPTIMIZER]) == held[PARAMS] + held[OPTIMIZER]
    assert torch.cuda.memory_allocated() == a0
    assert_same(params(t), p0)
    assert_same(opt_state(t), o0)
    t.train_step(batch)


# -- checkpoints ---------------------------------------------------------------------
@pytest.mark.parametrize("lora_rank, files", [(0, 1), (4, 1), (0, 3), (4, 2)])
def test_save_restore_round_trip(model_dir, tmp_path, monkeypatch, lora_rank, files):
    """Saved as one file, or as several (``state_file.shard_count``: one per core for a large state),
    it restores exactly."""
    from mllm_rl.backends.torch import state_file

    monkeypatch.setattr(state_file, "shard_count", lambda nbytes: files)
    a = trainer(model_dir, lora_rank=lora_rank)
    a.train_step(make_batch())
    a.save(tmp_path)
    # written under temporary names, renamed
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        state_file.shard_file(i) for i in range(files)
    )
    b = trainer(model_dir, lora_rank=lora_rank)
    b.restore(tmp_path)
    assert_same(params(b), params(a))
    assert_same(opt_state(b), opt_state(a))
    assert b.step == a.step == 1
    b.offload([PARAMS, OPTIMIZER])  # restored state offloads like any other (its storages are resizable)
    b.onload([PARAMS, OPTIMIZER])
    a.train_step(make_batch(seed=1))
    b.train_step(make_batch(seed=1))
    assert_same(params(b), params(a))
    other = trainer(model_dir, lora_rank=4 - lora_rank)
    with pytest.raises(ValueError, match="lora_rank"):
        other.restore(tmp_path)
    with pytest.raises(ValueError, match="no trainer state"):
        other.restore(tmp_path / "missing")


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_snapshot_holds_the_state_of_its_moment_and_writes_what_save_writes(model_dir, tmp_path, lora_rank):
    """What a background checkpoint writes: taken after step 1, written after the trainer trained,
    offloaded and onloaded again, it restores step 1's params and optimizer state exactly."""
    a = trainer(model_dir, lora_rank=lora_rank)
    a.train_step(make_batch())
    snap = a.snapshot()
    p1, o1 = params(a), opt_state(a)
    assert snap.nbytes == sum(t.numel() * t.element_size() for t in [*a.trainable.values(), *o1])
    a.train_step(make_batch(seed=1))
    a.offload([PARAMS, OPTIMIZER])
    a.onload([PARAMS, OPTIMIZER])
    for d in ("snap", "now"):
        (tmp_path / d).mkdir()
    written = {d: w(tmp_path / d) for d, w in (("snap", snap.write), ("now", a.save))}
    for d, manifest in written.items():  # hashed while written: what the checkpoint's manifest takes
        data = (tmp_path / d / "state.pt").read_bytes()
        assert manifest == {"state.pt": {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}
    b = trainer(model_dir, lora_rank=lora_rank)
    b.restore(tmp_path / "snap")
    assert_same(params(b), p1)
    assert_same(opt_state(b), o1)
    assert b.step == 1
    c = trainer(model_dir, lora_rank=lora_rank)
    c.restore(tmp_path / "now")
    assert c.step == 2 and any(not torch.equal(params(c)[n], p1[n]) for n in p1)
    a.offload([OPTIMIZER])
    with pytest.raises(TrainerStateError, match="optimizer offloaded"):
        a.snapshot()


@pytest.mark.slow
# -- the engine side -----------------------------------------------------------------
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_export_lands_in_the_embedded_engine_and_its_greedy_agrees(model_dir, lora_rank):
    t = trainer(model_dir, lora_rank=lora_rank)
    t.train_step(make_batch())
    engine = ManagedEngine(EmbeddedEngine(model_dir, device="cpu"))
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in engine.engine.params.items()}
    export = t.export_weights(full=True)
    assert sorted(export.names) == sorted(engine.weight_names()) and len(set(export.names)) == len(
        export.names
    )
    sent = []

    def check(items):
        for name, value in items:
            assert isinstance(value, torch.Tensor) and (tuple(value.shape), value.dtype) == shapes[name], name
            sent.append(name)
            yield name, value

    engine.update_weights(WeightExport(export.names, check(export), full=export.full))
    assert sent == export.names
    assert compare_fingerprints(t.weights_fingerprint(export.names), engine.weights_fingerprint()) == []
    # the export's own fingerprint (its pass) is the trainer's, and the engine's
    assert compare_fingerprints(export.fingerprint(), t.weights_fingerprint(export.names)) == []
    assert sorted(export.fingerprint()) == sorted(export.names)
    t.train_step(make_batch(seed=1))
    update = t.export_weights(full=False)  # LoRA: the merged linear layers only; full fine-tune: all
    assert update.full == (lora_rank == 0)
    engine.update_weights(update, expected=update.fingerprint)
    assert compare_fingerprints(t.weights_fingerprint(), engine.weights_fingerprint()) == []
    out = engine.generate([PROMPT], SamplingParams(max_new_tokens=8))[0]
    toks, margins = t.greedy(PROMPT, 8)
    assert out.token_ids == toks and len(margins) == len(toks) and min(margins) >= 0


def test_fingerprint_sees_a_changed_weight(model_dir):
    t = trainer(model_dir)
    fp = t.weights_fingerprint()
    with torch.no_grad():
        t.params["model.norm.weight"][0] += 1.0
    bad = compare_fingerprints(fp, t.weights_fingerprint())
    assert bad == ["model.norm.weight"]


@pytest.mark.slow
def test_logprobs_are_the_engines_sampling_logprobs(model_dir):
    """The alignment convention: ``old_logp[b, t]`` (engine) and ``logprobs[b, t]`` (trainer)
    are both log p(tokens[b, t] | tokens[b, :t]); on-policy the ratio is 1."""
    t = trainer(model_dir)
    t.train_step(make_batch())
    engine = ManagedEngine(EmbeddedEngine(model_dir, device="cpu"))
    engine.update_weights(t.export_weights())
    prompts = [PROMPT, PROMPT[:3], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0, seed=0))
    batch = build_batch(prompts, outs, np.ones(len(prompts), np.float32))
    lp = t.logprobs(batch)
    np.testing.assert_allclose(lp[batch.loss_mask], batch.old_logp[batch.loss_mask], atol=1e-4)
    assert (lp[~batch.attention_mask] == 0).all() and (lp[:, 0] == 0).all()
    m = t.train_step(batch)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and m["clip_frac"] == 0


def test_greedy_matches_the_reference_decoder(model_dir):
    t = trainer(model_dir)
    t.train_step(make_batch())
    for prompt in (PROMPT, [1, 2, 3]):
        toks, margins = t.greedy(prompt, 8)
        ref_toks, _ = greedy_decode(t.model, prompt, 8)
        assert toks == ref_toks and all(m >= 0 for m in margins)
        with torch.no_grad():
            logits = t.model(torch.tensor([prompt]))[0, -1]
        top2 = torch.topk(logits, 2).values
        assert margins[0] == pytest.approx(float(top2[0] - top2[1]), abs=1e-6)


# -- cross-backend: the JAX trainer on the same checkpoint, batch and config -----------
_JAX_TRAINER = r"""
import json, sys
import numpy as np
from mllm_rl.backends.jax.model import linear_layers
from mllm_rl.backends.jax.trainer import JaxTrainer
from mllm_rl.checkpoint import ModelDir
from mllm_rl.rl.loss_config import AGGREGATIONS, LossConfig
from mllm_rl.trainer import RolloutBatch, TrainConfig
d = np.load(sys.argv[2])
batch = RolloutBatch(d["tokens"], d["attention_mask"], d["loss_mask"], d["old_logp"], d["advantages"])
out = {}
for lora in (0, 4):
    cfg = TrainConfig(**json.loads(sys.argv[3]), lora_rank=lora, loss=LossConfig(**json.loads(sys.argv[4])))
    t = JaxTrainer(ModelDir.open(sys.argv[1]), cfg)
    a = {n: np.asarray(l.lora_a[...]).T.tolist() for n, l in linear_layers(t._model_view()).items()} if lora else {}
    metrics = [{k: v for k, v in t.train_step(batch).items() if k != "train_s"} for _ in range(2)]
    out[lora] = {"lora_a": a, "metrics": metrics, "fingerprint": t.weights_fingerprint()}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not JAX_PYTHON.exists(), reason=f"{JAX_PYTHON} absent (the JAX venv computes the reference)"
)
def test_two_steps_match_the_jax_trainer(model_dir, tmp_path):
    """Full fine-tune and LoRA (torch adapters started from JAX's lora_a), KL in the loss, 2 mini-batches
    of micro-batches of 5 rows: metrics and the exported weights agree after 2 steps."""
    batch = make_batch(b=12, seed=5)
    data = tmp_path / "batch.npz"
    np.savez(data, **{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)})
    train = {"lr": 1e-2, "micro_batch_size": 5, "mini_batches": 2, "weight_decay": 0.1}
    loss = {"beta": 0.05, "eps_high": 0.28}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run([str(JAX_PYTHON), "-c", _JAX_TRAINER, str(model_dir.path), str(data), json.dumps(train),
                        json.dumps(loss)], capture_output=True, text=True, timeout=600,
                       env={**env, "JAX_PLATFORMS": "cpu"}, cwd=ROOT)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    want = json.loads(r.stdout.split("RESULT", 1)[1])
    for lora in (0, 4):
        t = TorchTrainer(model_dir, TrainConfig(**train, lora_rank=lora, loss=LossConfig(**loss)))
        with torch.no_grad():
            for name, a in want[str(lora)]["lora_a"].items():
                t.adapters[name].lora_a.copy_(torch.tensor(a))
        for w in want[str(lora)]["metrics"]:
            m = t.train_step(batch)
            for k, v in w.items():
                assert m[k] == pytest.approx(v, rel=1e-3, abs=1e-5), (lora, k)
        got = t.weights_fingerprint()
        for name, (s, q) in want[str(lora)]["fingerprint"].items():
            assert got[name][1] == pytest.approx(q, rel=1e-4), (lora, name)
            assert got[name][0] == pytest.approx(s, rel=1e-3, abs=1e-3 * q**0.5), (lora, name)

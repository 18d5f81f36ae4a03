"""Oracle: Qwen3 checkpoints built by transformers itself (the 5.x installed here), read by the
torch backend — config, model logits, trainer log-probs, greedy tokens of the model, the
trainer and the embedded engine — against transformers' own forward and ``generate``.

Configs (``tests/hf_oracle.py``): head_dim != hidden / heads, GQA / MQA / MHA, tied / untied,
two eps, three RoPE bases; each as transformers 5.x writes it (``rope_parameters``, no
top-level ``rope_theta``), as 4.x writes it (top-level ``rope_theta``), and with the optional
keys removed (transformers' defaults). Tolerance: 1e-4 relative (fp32); tokens equal.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from mllm_rl.backends.torch.engine import EmbeddedEngine
from mllm_rl.backends.torch.model import greedy_decode, load_qwen3
from mllm_rl.backends.torch.trainer import TorchTrainer
from mllm_rl.checkpoint import ModelDir
from mllm_rl.engine import SamplingParams, WeightExport
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.trainer import RolloutBatch, TrainConfig
from tests import hf_oracle as oracle

TOL = 1e-4
CASES = [("gqa", "v5"), ("gqa", "v4"), ("mqa_tied", "v5"), ("mqa_tied", "v4"), ("mha_defaults", "stripped")]


@pytest.fixture(scope="module", params=CASES, ids=[f"{s}-{style}" for s, style in CASES])
def case(request, tmp_path_factory):
    """(ModelDir, transformers' answers, the config.json on disk)."""
    spec, style = request.param
    out = oracle.build(spec, tmp_path_factory.mktemp(f"{spec}-{style}"))
    cfg = json.loads((out / "config.json").read_text())
    if style == "v4":
        cfg = oracle.to_v4_style(cfg)
        (out / "config.json").write_text(json.dumps(cfg))
    return ModelDir.open(out), oracle.answers(out), cfg


def right_batch() -> RolloutBatch:
    loss_mask = oracle.RIGHT_MASK.copy()
    loss_mask[:, 0] = False
    b = oracle.RIGHT_TOKENS.shape[0]
    return RolloutBatch(oracle.RIGHT_TOKENS.astype(np.int32), oracle.RIGHT_MASK, loss_mask,
                        np.zeros(oracle.RIGHT_TOKENS.shape, np.float32), np.zeros(b, np.float32))  # fmt: skip


def mixed_logits(model) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(oracle.MIXED_TOKENS), torch.from_numpy(oracle.MIXED_MASK)).numpy()


def test_the_written_config_has_the_style_under_test(case):
    _, _, cfg = case
    if "rope_parameters" in cfg:  # transformers 5.x: the base lives only in the RoPE dict
        assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_type"] == "default"
    else:
        assert cfg.get("rope_scaling") is None


def test_config_is_what_transformers_reads(case):
    md, ans, _ = case
    c, want = md.config, ans["config"]
    got = {"rope_theta": c.rope_theta, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
           "tie_word_embeddings": c.tie_word_embeddings, "num_key_value_heads": c.num_key_value_heads}  # fmt: skip
    assert got == want


def test_model_logits_match_transformers_with_left_and_right_padding(case):
    md, ans, _ = case
    got, want = mixed_logits(load_qwen3(md)), ans["mixed_logits"]
    assert oracle.rel_err(got[oracle.MIXED_MASK], want[oracle.MIXED_MASK]) <= TOL


def test_a_wrong_rope_base_would_be_caught(case):
    """The comparison can fail: the same weights with transformers 4.x's fallback base (10000),
    or 1e6 where that is the default, are far outside the tolerance."""
    md, ans, _ = case
    other = 1e6 if md.config.rope_theta == 10_000.0 else 10_000.0
    wrong = ModelDir(md.path, dataclasses.replace(md.config, rope_theta=other), md.tensors)
    got, want = mixed_logits(load_qwen3(wrong)), ans["mixed_logits"]
    assert oracle.rel_err(got[oracle.MIXED_MASK], want[oracle.MIXED_MASK]) > 100 * TOL


def test_trainer_logprobs_match_transformers(case):
    md, ans, _ = case
    got = TorchTrainer(md, TrainConfig()).logprobs(right_batch())
    assert got.shape == ans["right_logp"].shape
    assert oracle.rel_err(got, ans["right_logp"]) <= TOL


def test_greedy_tokens_match_transformers_generate(case):
    md, ans, _ = case
    model, trainer = load_qwen3(md), TorchTrainer(md, TrainConfig())
    for prompt, want in zip(oracle.PROMPTS, ans["greedy"], strict=True):
        toks, lps = greedy_decode(model, prompt, oracle.N_NEW)
        assert toks == want["tokens"]
        assert oracle.rel_err(lps, want["logprobs"]) <= TOL
        assert trainer.greedy(prompt, oracle.N_NEW)[0] == want["tokens"]


def test_embedded_engine_greedy_matches_transformers_generate(case):
    md, ans, _ = case
    eng = ManagedEngine(EmbeddedEngine(md, device="cpu", max_total_tokens=256, context_length=64))
    eng.update_weights(WeightExport(list(md.tensors), md.iter_tensors(), full=True))
    outs = eng.generate(
        oracle.PROMPTS, SamplingParams(max_new_tokens=oracle.N_NEW, stop_token_ids=(oracle.EOS,))
    )
    for out, want in zip(outs, ans["greedy"], strict=True):
        assert out.token_ids == want["tokens"]
        assert oracle.rel_err(out.logprobs, want["logprobs"]) <= TOL
    eng.shutdown()


@pytest.mark.parametrize("name", sorted(oracle.CONFIG_CASES))
def test_config_variants_read_as_transformers5_reads_them(name):
    """Config-only cases (``tests/hf_oracle.CONFIG_CASES``) against this venv's Qwen3Config
    (5.x): every field, the RoPE base included, agrees."""
    cfg = oracle.config_case(name)
    assert oracle.our_reading(cfg) == oracle.transformers_reading(cfg)

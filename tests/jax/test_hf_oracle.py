"""Oracle: Qwen3 checkpoints built by transformers itself, read by the JAX backend — config,
flax model logits, trainer log-probs, greedy tokens of the model and the trainer, and (slow)
the sglang-jax engine — against transformers' own forward and ``generate``.

This venv has transformers 4.57 but no torch: the checkpoints and transformers' answers come
from ``python -m tests.hf_oracle`` run in ``.venv-torch`` (transformers 5.x). Config styles:
written by this venv's transformers 4.57 (top-level ``rope_theta``), by 5.x
(``rope_parameters`` only), and with the optional keys removed (defaults). sglang-jax reads
config.json itself with transformers 4.57, which falls back to RoPE base 10000 on a 5.x file:
the adapter hands it our config (``json_model_override_args``), checked here through
sglang-jax's own ``get_config`` and, slow, on a running engine. Tolerance: 1e-4 relative
(fp32); tokens equal.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from mllm_rl.checkpoint import ModelDir
from mllm_rl.sinks.jsonl import read_jsonl
from mllm_rl.trainer import RolloutBatch, TrainConfig
from tests import hf_oracle as oracle
from tests.conftest import ROOT, run_cli

# every test reads checkpoints and answers made by transformers in .venv-torch (the module's
# ``built``): the other venv's interpreter, so the whole module is slow (make test-fast skips it)
pytestmark = pytest.mark.slow
TOL = 1e-4
TORCH_PY = ROOT / ".venv-torch" / "bin" / "python"
CASES = [("gqa", "v4"), ("gqa", "v5"), ("mqa_tied", "v4"), ("mha_defaults", "stripped")]


def build(jobs: list[tuple[str, Path, str, list[list[int]] | None]]) -> None:
    """Transformers-built checkpoints + transformers' answers, made in ``.venv-torch`` (one
    process for all). A job is (spec, out dir, style, prompts); style "v4": config.json as this
    venv's transformers (4.57) writes it."""
    if not TORCH_PY.exists():
        pytest.skip(f"{TORCH_PY} absent: transformers' Qwen3ForCausalLM needs torch (make venv-torch)")
    from transformers import Qwen3Config

    batch = []
    for spec, out, style, prompts in jobs:
        job = {"spec": spec, "out": str(out), "prompts": prompts}
        if style == "v4":
            written = out.parent / f"{out.name}-config-4x"
            Qwen3Config(**oracle.SPECS[spec]).save_pretrained(str(written))
            job["config_json"] = str(written / "config.json")
        batch.append(job)
    jobs_file = jobs[0][1].parent / "jobs.json"
    jobs_file.write_text(json.dumps(batch))
    r = subprocess.run([str(TORCH_PY), "-m", "tests.hf_oracle", "--batch", str(jobs_file)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("hf")
    dirs = {(spec, style): root / f"{spec}-{style}" for spec, style in CASES}
    build([(spec, out, style, None) for (spec, style), out in dirs.items()])
    return dirs


@pytest.fixture(scope="module", params=CASES, ids=[f"{s}-{style}" for s, style in CASES])
def case(request, built):
    """(ModelDir, transformers' answers, the config.json on disk)."""
    out = built[request.param]
    return ModelDir.open(out), oracle.load_answers(out), json.loads((out / "config.json").read_text())


@pytest.fixture(scope="module")
def jax_trainer(case):
    from mllm_rl.backend_registry import load_backend

    return load_backend("jax").create_trainer(case[0], TrainConfig())


def batch_of(rows: list[list[int]]) -> RolloutBatch:
    """Right-padded rows as a trainer's ``RolloutBatch`` (no loss terms needed)."""
    t = max(map(len, rows))
    tokens, mask = np.zeros((len(rows), t), np.int32), np.zeros((len(rows), t), bool)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], mask[i, : len(r)] = r, True
    zeros = np.zeros((len(rows), t), bool)
    return RolloutBatch(
        tokens, mask, zeros, np.zeros((len(rows), t), np.float32), np.zeros(len(rows), np.float32)
    )


def mixed_logits(md: ModelDir) -> np.ndarray:
    from flax import nnx

    from mllm_rl.backends.jax.model import load_qwen3

    fwd = nnx.jit(lambda m, x, a: m(x, a))
    return np.asarray(
        fwd(load_qwen3(md), jnp.asarray(oracle.MIXED_TOKENS, jnp.int32), jnp.asarray(oracle.MIXED_MASK))
    )


def test_the_written_config_has_the_style_under_test(case):
    _, _, cfg = case
    if cfg.get("transformers_version", "").startswith("4."):
        assert "rope_parameters" not in cfg and cfg.get("rope_scaling") is None
    elif "rope_parameters" in cfg:
        assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_type"] == "default"


def test_config_is_what_transformers_reads(case):
    md, ans, _ = case
    c = md.config
    got = {"rope_theta": c.rope_theta, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
           "tie_word_embeddings": c.tie_word_embeddings, "num_key_value_heads": c.num_key_value_heads}  # fmt: skip
    assert got == ans["config"]


def test_model_logits_match_transformers_with_left_and_right_padding(case):
    md, ans, _ = case
    got, want = mixed_logits(md), ans["mixed_logits"]
    assert oracle.rel_err(got[oracle.MIXED_MASK], want[oracle.MIXED_MASK]) <= TOL


def test_a_wrong_rope_base_would_be_caught(case):
    md, ans, _ = case
    other = 1e6 if md.config.rope_theta == 10_000.0 else 10_000.0
    wrong = ModelDir(md.path, dataclasses.replace(md.config, rope_theta=other), md.tensors)
    got, want = mixed_logits(wrong), ans["mixed_logits"]
    assert oracle.rel_err(got[oracle.MIXED_MASK], want[oracle.MIXED_MASK]) > 100 * TOL


def test_trainer_logprobs_match_transformers(case, jax_trainer):
    _, ans, _ = case
    rows = [list(r[m]) for r, m in zip(oracle.RIGHT_TOKENS, oracle.RIGHT_MASK, strict=True)]
    got = jax_trainer.logprobs(batch_of(rows))
    assert oracle.rel_err(got, ans["right_logp"]) <= TOL


def test_trainer_greedy_matches_transformers_generate(case, jax_trainer):
    """Tokens from the trainer's greedy (the garbage guard's reference), their log-probs from
    the trainer's forward, against ``generate``'s tokens and log-probs."""
    _, ans, _ = case
    outs = [jax_trainer.greedy(p, oracle.N_NEW)[0] for p in oracle.PROMPTS]
    assert outs == [g["tokens"] for g in ans["greedy"]]
    lp = jax_trainer.logprobs(batch_of([p + o for p, o in zip(oracle.PROMPTS, outs, strict=True)]))
    got = [lp[i, len(p) : len(p) + len(o)] for i, (p, o) in enumerate(zip(oracle.PROMPTS, outs, strict=True))]
    assert oracle.rel_err(np.concatenate(got), np.concatenate([g["logprobs"] for g in ans["greedy"]])) <= TOL


def test_sglang_jax_config_gets_our_rope_base(case):
    """sglang-jax's own ``get_config`` (transformers 4.57) with the adapter's overrides."""
    from sgl_jax.srt.hf_transformers_utils import get_config

    md, _, cfg = case
    raw = get_config(str(md.path), trust_remote_code=False)
    if "rope_parameters" in cfg:  # what the engine computed before the hand-off existed
        assert raw.rope_theta == 10_000.0 != md.config.rope_theta
    seen = get_config(str(md.path), trust_remote_code=False, model_override_args=md.config.hf_architecture())
    assert seen.rope_theta == md.config.rope_theta and seen.rope_scaling is None
    for field in ("head_dim", "rms_norm_eps", "tie_word_embeddings", "num_key_value_heads", "hidden_size"):
        assert getattr(seen, field) == getattr(md.config, field), field


def test_sglang_jax_greedy_equals_trainer_and_transformers_on_a_transformers5_checkpoint(tmp_path):
    """``python -m mllm_rl.run --plan swap --model DIR``: the engine's greedy tokens on a
    checkpoint whose config.json has only ``rope_parameters`` (base 1e6; 4.57 alone would use 1e4)."""
    from transformers import AutoTokenizer

    from mllm_rl.backend_registry import load_backend

    texts = ["The capital of France is", "abcabcabc"]
    tok = AutoTokenizer.from_pretrained(str(oracle.TOKENIZER_DIR))
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    ckpt = tmp_path / "sglang-v5"
    build([("sglang", ckpt, "v5", prompts)])
    cfg = json.loads((ckpt / "config.json").read_text())
    assert "rope_theta" not in cfg and cfg["rope_parameters"]["rope_theta"] == 1e6
    args = [a for t in texts for a in ("--prompt", t)]
    r = run_cli("mllm_rl.run", "--backend", "jax", "--plan", "swap", "--model", str(ckpt), "--run-dir",
                str(tmp_path / "run"), "--max-new-tokens", str(oracle.N_NEW), "--wandb", "disabled", "--quiet",
                *args, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    gen = read_jsonl(tmp_path / "run" / "phases.jsonl")[-1]
    assert gen["phase"] == "generate_result" and gen["info"]["prompt_ids"] == prompts
    ans, md = oracle.load_answers(ckpt), ModelDir.open(ckpt)
    trainer = load_backend("jax").create_trainer(md, TrainConfig())
    for prompt, toks, lps, want in zip(prompts, gen["info"]["token_ids"], gen["info"]["logprobs"], ans["greedy"],
                                       strict=True):  # fmt: skip
        assert toks == want["tokens"] == trainer.greedy(prompt, oracle.N_NEW)[0]
        assert oracle.rel_err(lps, want["logprobs"]) <= TOL

"""The Hugging Face oracle: small Qwen3 checkpoints built by ``transformers`` itself
(``Qwen3ForCausalLM(Qwen3Config(...))`` + ``save_pretrained`` + the shipped tokenizer), and
transformers' own answers on them: logits of a left- and right-padded batch, log-probs of
a right-padded batch (what a trainer computes), ``generate`` greedy tokens and their log-probs.

Building needs torch (``.venv-torch``). The JAX tests (``.venv-jax`` has no torch) run this
module there as a script and read the answers from ``oracle.npz`` / ``oracle.json``:

    .venv-torch/bin/python -m tests.hf_oracle --spec gqa --out DIR [--config-json FILE]
    .venv-torch/bin/python -m tests.hf_oracle --batch JOBS.json   # several, one torch import

``--config-json`` replaces the ``config.json`` that ``save_pretrained`` wrote (a config written
by another transformers version, or one with keys removed) *before* the answers are
computed: they are what transformers makes of the directory as it is on disk.

Shapes: B rows, T positions, V vocab. Module level imports no torch (the JAX tests import
the specs and inputs from here).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "mllm_rl" / "assets" / "tokenizer"
EOS = 256  # <|endoftext|> of the shipped tokenizer
_BASE = {"vocab_size": 320, "num_hidden_layers": 2, "intermediate_size": 96, "eos_token_id": EOS}

# Qwen3Config keyword arguments: a handful of shapes that catch a wrong reading of a field.
SPECS: dict[str, dict[str, Any]] = {
    # GQA, head_dim (32) != hidden / heads (16), untied head, a non-default base.
    "gqa": {**_BASE, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "rope_theta": 500_000.0, "tie_word_embeddings": False},
    # MQA, tied embeddings, another eps, head_dim (16) != hidden / heads (8).
    "mqa_tied": {**_BASE, "hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 1,
                 "head_dim": 16, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
    # MHA; its config.json keeps none of head_dim / eps / RoPE / tie / max positions (see STRIP):
    # transformers' defaults (head_dim 128, not hidden / heads = 32; base 10000; untied) apply.
    "mha_defaults": {**_BASE, "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
                     "head_dim": 128, "tie_word_embeddings": False},
    # sglang-jax on CPU needs head_dim % 128 == 0.
    "sglang": {**_BASE, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 128, "rope_theta": 1_000_000.0, "tie_word_embeddings": False},
}  # fmt: skip
# Keys removed from the written config.json of a spec (transformers' defaults then apply).
STRIP = {
    "mha_defaults": ("head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
                     "tie_word_embeddings", "max_position_embeddings"),
}  # fmt: skip
SEED = 1234

# config.json variants read by ``mllm_rl.checkpoint.hf_config.parse_qwen3`` and by transformers' Qwen3Config
# (no weights): each is ``SIZES`` plus the entries shown. ``V4_DIFFERS``: 4.x reads these
# with another RoPE base than 5.x (it never reads a RoPE dict's base); we follow 5.x.
SIZES = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "eos_token_id": EOS}  # fmt: skip
CONFIG_CASES: dict[str, dict[str, Any]] = {
    "no_optional_keys": {},
    "v4_rope_theta": {"rope_theta": 500_000.0, "rope_scaling": None},
    "v5_rope_parameters": {"rope_parameters": {"rope_type": "default", "rope_theta": 500_000.0}},
    "v5_per_layer_type": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 200_000.0}},
                          "layer_types": ["full_attention", "full_attention"]},
    "both_places_agree": {"rope_theta": 300_000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 300_000.0}},
    "legacy_type_key": {"rope_scaling": {"type": "default"}, "rope_theta": 300_000.0},
    "rope_dict_without_base": {"rope_parameters": {"rope_type": "default"}, "rope_theta": 40_000.0},
    "kv_heads_null_is_mha": {"num_key_value_heads": None},
    "explicit_values": {"head_dim": 48, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
                        "max_position_embeddings": 4096, "hidden_act": "swish", "use_sliding_window": False,
                        "sliding_window": 4096, "max_window_layers": 1, "attention_dropout": 0},
}  # fmt: skip
V4_DIFFERS = {"v5_rope_parameters", "v5_per_layer_type"}


def config_case(name: str) -> dict[str, Any]:
    return {**SIZES, **json.loads(json.dumps(CONFIG_CASES[name]))}  # a fresh deep copy


def transformers_reading(cfg: dict[str, Any]) -> dict[str, Any]:
    """The fields of ``Qwen3Config.from_dict(cfg)`` in the installed transformers (4.x or 5.x)."""
    from transformers import Qwen3Config

    c = Qwen3Config.from_dict(json.loads(json.dumps(cfg)))
    if _is_v5():  # 5.x: the base lives in rope_parameters (per layer type when nested)
        rope = c.rope_parameters
        theta = (rope["full_attention"] if "full_attention" in rope else rope)["rope_theta"]
    else:  # 4.x: top-level rope_theta only
        theta = c.rope_theta
    return {"rope_theta": float(theta), "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "tie_word_embeddings": bool(c.tie_word_embeddings), "num_key_value_heads": c.num_key_value_heads,
            "max_position_embeddings": c.max_position_embeddings}  # fmt: skip


def _is_v5() -> bool:
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


def our_reading(cfg: Any) -> dict[str, Any]:
    from mllm_rl.checkpoint.hf_config import parse_qwen3

    c = parse_qwen3(cfg)
    return {"rope_theta": c.rope_theta, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
            "tie_word_embeddings": c.tie_word_embeddings, "num_key_value_heads": c.num_key_value_heads,
            "max_position_embeddings": c.max_position_embeddings}  # fmt: skip


# One length: a jitted greedy step then compiles once for all prompts.
PROMPTS = [
    [51, 71, 68, 220, 66, 64, 79, 72],
    [160, 121, 254, 162, 3, 99, 17, 9],
    [72, 83, 64, 75, 1, 2, 3, 90],
]
N_NEW = 10
# [B, T]: row 0 full, row 1 left-padded (3), row 2 right-padded (2).
MIXED_TOKENS = np.array(
    [[51, 71, 68, 220, 66, 64, 79, 72, 30], [0, 0, 0, 160, 121, 254, 162, 3, 99], [72, 83, 64, 75, 1, 2, 3, 0, 0]],
    np.int64,
)  # fmt: skip
MIXED_MASK = MIXED_TOKENS != 0
MIXED_MASK[1, :3] = False
MIXED_MASK[2, 7:] = False
# [B, T] right-padded rows (a trainer's ``RolloutBatch``).
RIGHT_TOKENS = np.array(
    [[51, 71, 68, 220, 66, 64, 79, 72, 30, 5], [160, 121, 254, 162, 3, 99, 0, 0, 0, 0], [9, 250, 17, 0, 0, 0, 0, 0, 0, 0]],
    np.int64,
)  # fmt: skip
RIGHT_MASK = np.zeros(RIGHT_TOKENS.shape, bool)
for _i, _n in enumerate((10, 6, 3)):
    RIGHT_MASK[_i, :_n] = True


def strip_keys(cfg: dict[str, Any], spec: str) -> dict[str, Any]:
    return {k: v for k, v in cfg.items() if k not in STRIP.get(spec, ())}


def to_v4_style(cfg: dict[str, Any]) -> dict[str, Any]:
    """A transformers-5 ``config.json`` rewritten the way 4.x writes it (top-level ``rope_theta``)."""
    out = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    out["rope_scaling"] = None
    return out


def build(spec: str, out: Path, config_json: dict[str, Any] | None = None) -> Path:
    """Write a checkpoint of ``SPECS[spec]`` with transformers (float32). Weights are drawn
    like ``mllm_rl.checkpoint.make``'s (N(0, 1/fan_in) matrices; norms 1 + N(0, 0.1^2), so a
    mix-up of norm weights shows): peaked logits, stable greedy tokens. ``config_json``
    (else the spec's ``STRIP``) replaces the written config.json."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(Qwen3Config(**SPECS[spec])).float().eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy2(f, out / f.name)
    written = json.loads((out / "config.json").read_text())
    cfg = config_json if config_json is not None else strip_keys(written, spec)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def answers(ckpt: Path, prompts: list[list[int]] | None = None) -> dict[str, Any]:
    """transformers' forward and ``generate`` (on ``prompts``, default ``PROMPTS``) on ``ckpt``
    as loaded by ``from_pretrained``."""
    import torch
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()

    def forward(tokens: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        m = torch.from_numpy(mask)
        positions = (m.long().cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            return hf(
                input_ids=torch.from_numpy(tokens), attention_mask=m.long(), position_ids=positions
            ).logits

    mixed = forward(MIXED_TOKENS, MIXED_MASK).float()
    right = forward(RIGHT_TOKENS, RIGHT_MASK).float().log_softmax(-1)
    tgt = torch.from_numpy(RIGHT_TOKENS[:, 1:, None])
    logp = np.zeros(RIGHT_TOKENS.shape, np.float32)
    logp[:, 1:] = right[:, :-1].gather(-1, tgt)[..., 0].numpy()
    logp[~RIGHT_MASK] = 0.0
    greedy = []
    for prompt in prompts or PROMPTS:
        with torch.no_grad():
            g = hf.generate(
                input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=N_NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
                eos_token_id=EOS, pad_token_id=EOS,
            )  # fmt: skip
        toks = g.sequences[0, len(prompt) :].tolist()
        lps = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(g.logits, toks, strict=True)]
        greedy.append({"tokens": toks, "logprobs": lps})
    rope = getattr(hf.config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf.config, "rope_theta", None))
    return {
        "mixed_logits": mixed.numpy(),  # [B, T, V]
        "right_logp": logp,  # [B, T], 0 at t = 0 and on padding
        "greedy": greedy,
        "config": {"rope_theta": theta, "head_dim": hf.config.head_dim, "rms_norm_eps": hf.config.rms_norm_eps,
                   "tie_word_embeddings": bool(hf.config.tie_word_embeddings),
                   "num_key_value_heads": hf.config.num_key_value_heads},
    }  # fmt: skip


def save_answers(ans: dict[str, Any], out: Path) -> None:
    np.savez(out / "oracle.npz", mixed_logits=ans["mixed_logits"], right_logp=ans["right_logp"])
    (out / "oracle.json").write_text(json.dumps({"greedy": ans["greedy"], "config": ans["config"]}))


def load_answers(out: Path) -> dict[str, Any]:
    arrays = np.load(out / "oracle.npz")
    return {**json.loads((out / "oracle.json").read_text()), **{k: arrays[k] for k in arrays.files}}


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (the suite's tolerance is 1e-4)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.hf_oracle", description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", choices=sorted(SPECS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--config-json", type=Path, help="config.json to install instead of the written one")
    ap.add_argument("--prompts", type=json.loads, help="JSON list of token-id lists for generate")
    ap.add_argument(
        "--batch", type=Path, help='JSON file: [{"spec", "out", "config_json"?, "prompts"?}, ...]'
    )
    args = ap.parse_args(argv)
    if args.batch:
        jobs = json.loads(args.batch.read_text())
    elif args.spec and args.out:
        jobs = [{"spec": args.spec, "out": str(args.out), "config_json": args.config_json and str(args.config_json),
                 "prompts": args.prompts}]  # fmt: skip
    else:
        ap.error("give --spec and --out, or --batch")
    for job in jobs:
        cfg = json.loads(Path(job["config_json"]).read_text()) if job.get("config_json") else None
        out = build(job["spec"], Path(job["out"]), cfg)
        save_answers(answers(out, job.get("prompts")), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

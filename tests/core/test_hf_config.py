"""Reading ``config.json`` (``mllm_rl/checkpoint/hf_config.py``): transformers' meaning for every
Qwen3 field, a one-line refusal naming the field for what we do not compute, and a one-line
error naming the file for malformed files (also from ``python -m mllm_rl.checkpoint check``).

The oracle is the installed transformers' ``Qwen3Config`` (4.57 in this venv; the same
cases against 5.x run in tests/torch/test_hf_oracle.py).
"""

from __future__ import annotations

import json
import shutil

import pytest

from mllm_rl.checkpoint import CheckpointError, ModelDir
from mllm_rl.checkpoint.hf_config import parse_qwen3
from mllm_rl.presets import PRESETS
from tests import hf_oracle as oracle
from tests.conftest import run_cli

_DROP = object()  # a value meaning "remove this key"


def parse(**changes):
    cfg = {**oracle.SIZES, **changes}
    return parse_qwen3({k: v for k, v in cfg.items() if v is not _DROP})


@pytest.mark.parametrize("case", sorted(oracle.CONFIG_CASES))
def test_fields_read_as_the_installed_transformers_reads_them(case):
    pytest.importorskip("transformers")
    cfg = oracle.config_case(case)
    ours, theirs = oracle.our_reading(cfg), oracle.transformers_reading(cfg)
    if case in oracle.V4_DIFFERS and not oracle._is_v5():
        # transformers 4.x never reads a RoPE dict's base and falls back to 10000; we follow 5.x.
        assert theirs["rope_theta"] == 10_000.0 != ours["rope_theta"]
        ours.pop("rope_theta"), theirs.pop("rope_theta")
    assert ours == theirs


def test_defaults_are_qwen3configs_not_derived_ones():
    c = parse()
    assert c.head_dim == 128  # not hidden_size // num_attention_heads (16)
    assert c.rope_theta == 10_000.0 and c.tie_word_embeddings is False
    assert c.max_position_embeddings == 32768 and c.rms_norm_eps == 1e-6


def test_transformers5_rope_parameters_base_is_read():
    c = parse(rope_parameters={"rope_theta": 5e5, "rope_type": "default"})
    assert c.rope_theta == 5e5


def test_presets_round_trip_and_hf_architecture_pins_every_default():
    for cfg in PRESETS.values():
        assert parse_qwen3(cfg.to_hf_config()) == cfg
        arch = cfg.hf_architecture()
        assert arch["rope_theta"] == cfg.rope_theta and arch["rope_scaling"] is None
        assert {"head_dim", "tie_word_embeddings", "rms_norm_eps", "num_key_value_heads"} <= set(arch)


REFUSED = {
    "yarn": ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
             r"^rope_scaling: rope_type 'yarn' is not implemented"),
    "linear_v5": ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}},
                  r"^rope_parameters: rope_type 'linear'"),
    "legacy_dynamic": ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"^rope_scaling: rope_type 'dynamic'"),
    "bases_disagree": ({"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
                       r"^rope_theta = 1e\+06 but rope_parameters.rope_theta = 500000 \(transformers 4.x"),
    "two_rope_dicts": ({"rope_scaling": {"rope_type": "default"}, "rope_parameters": {"rope_type": "default"}},
                       r"^rope_scaling and rope_parameters both given"),
    "sliding_layer_rope": ({"rope_parameters": {"sliding_attention": {"rope_type": "default"}, "full_attention": None}},
                           r"^rope_parameters.full_attention: None \(layers without RoPE"),
    "partial_rotary": ({"partial_rotary_factor": 0.5}, r"^partial_rotary_factor: 0.5 \(partial RoPE"),
    "partial_rotary_dict": ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}},
                            r"^rope_parameters.partial_rotary_factor: 0.25"),
    "rope_dict_not_object": ({"rope_scaling": "yarn"}, r"^rope_scaling: 'yarn', expected an object"),
    "sliding_window": ({"use_sliding_window": True, "sliding_window": 128}, r"^use_sliding_window: True \(sliding"),
    "sliding_layer_types": ({"layer_types": ["full_attention", "sliding_attention"]},
                            r"^layer_types: sliding_attention layers are not implemented"),
    "layer_types_length": ({"layer_types": ["full_attention"]}, r"^layer_types: expected a list of 2 entries"),
    "attention_bias": ({"attention_bias": True}, r"^attention_bias: True \(biased"),
    "gelu": ({"hidden_act": "gelu"}, r"^hidden_act: 'gelu' is not implemented"),
    "dropout": ({"attention_dropout": 0.1}, r"^attention_dropout: 0.1 \(dropout"),
    "quantized": ({"quantization_config": {"quant_method": "fp8"}}, r"^quantization_config: quantized"),
    "model_type": ({"model_type": "qwen2"}, r"^model_type: 'qwen2', expected 'qwen3'"),
    "architectures": ({"architectures": ["Qwen3ForSequenceClassification"]}, r"^architectures: \['Qwen3ForSeq"),
    "heads_zero": ({"num_attention_heads": 0}, r"^num_attention_heads: 0 must be > 0"),
    "hidden_negative": ({"hidden_size": -64}, r"^hidden_size: -64 must be > 0"),
    "vocab_float": ({"vocab_size": 320.5}, r"^vocab_size: 320.5, expected a positive integer"),
    "layers_string": ({"num_hidden_layers": "2"}, r"^num_hidden_layers: '2', expected a positive integer"),
    "layers_bool": ({"num_hidden_layers": True}, r"^num_hidden_layers: True, expected a positive integer"),
    "kv_not_dividing": ({"num_key_value_heads": 3}, r"^num_key_value_heads: 3 does not divide num_attention_heads 4"),
    "head_dim_null": ({"head_dim": None}, r"^head_dim: None, expected a positive integer"),
    "head_dim_odd": ({"head_dim": 33}, r"^head_dim: 33 is odd"),
    "theta_zero": ({"rope_theta": 0}, r"^rope_theta: 0.0 must be > 0"),
    "theta_nan": ({"rope_theta": float("nan")}, r"^rope_theta: nan, expected a finite number"),
    "theta_null": ({"rope_theta": None}, r"^rope_theta: None, expected a finite number"),
    "eps_negative": ({"rms_norm_eps": -1e-6}, r"^rms_norm_eps: -1e-06 is negative"),
    "tie_string": ({"tie_word_embeddings": "yes"}, r"^tie_word_embeddings: 'yes', expected true or false"),
    "eos_missing": ({"eos_token_id": _DROP}, r"^eos_token_id: missing"),
    "eos_out_of_vocab": ({"eos_token_id": 999}, r"^eos_token_id: 999, expected a token id in \[0, 320\)"),
    "size_missing": ({"intermediate_size": _DROP}, r"^missing field\(s\) intermediate_size"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_or_invalid_field_is_one_line_naming_it(case):
    changes, pattern = REFUSED[case]
    with pytest.raises(ValueError, match=pattern) as e:
        parse(**changes)
    assert "\n" not in str(e.value)


def test_harmless_fields_are_accepted():
    c = parse(use_cache=False, initializer_range=0.5, pad_token_id=0, transformers_version="5.23.0",
              sliding_window=None, max_window_layers=0, dtype="float32", bos_token_id=[1],
              eos_token_id=[256, 257], rope_scaling=None, rope_parameters={})  # fmt: skip
    assert c.torch_dtype == "float32" and c.bos_token_id == 1 and c.eos_token_id == 256


# -- files ----------------------------------------------------------------------------------
@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, dst)
    return dst


def _edit(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


FILES = {
    "array": (lambda p: (p / "config.json").write_text("[1, 2]"), r"config\.json: expected a JSON object, got an array"),
    "number": (lambda p: (p / "config.json").write_text("3"), r"config\.json: expected a JSON object, got a number"),
    "null": (lambda p: (p / "config.json").write_text("null"), r"config\.json: expected a JSON object, got null"),
    "binary": (lambda p: (p / "config.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe"),
               r"config\.json: not UTF-8 text \(byte 0\)"),
    "directory": (lambda p: ((p / "config.json").unlink(), (p / "config.json").mkdir()), r"config\.json: cannot read"),
    "heads_zero": (lambda p: _edit(p, num_attention_heads=0), r"config\.json: num_attention_heads: 0 must be > 0"),
    "yarn": (lambda p: _edit(p, rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"config\.json: rope_scaling"),
    "bad_generation_config": (lambda p: (p / "generation_config.json").write_bytes(b"\xff\x00"),
                              r"generation_config\.json: not UTF-8 text"),
    "index_binary": (lambda p: (p / "model.safetensors.index.json").write_bytes(b"\xff\xd8\xff"),
                     r"model\.safetensors\.index\.json: not UTF-8 text"),
    "index_not_object": (lambda p: (p / "model.safetensors.index.json").write_text("[]"),
                         r"model\.safetensors\.index\.json: invalid index"),
    "tokenizer_array": (lambda p: (p / "tokenizer.json").write_text("[]"), r"tokenizer\.json: not a tokenizers JSON"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(FILES))
def test_malformed_file_is_one_line_naming_it(ckpt, case):
    damage, pattern = FILES[case]
    damage(ckpt)
    with pytest.raises(CheckpointError, match=pattern) as e:
        ModelDir.open(ckpt)
    assert "\n" not in str(e.value) and str(ckpt) in str(e.value)


def test_missing_eos_falls_back_to_generation_config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["eos_token_id"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [257, 256]}))
    assert ModelDir.open(ckpt).config.eos_token_id == 257


@pytest.mark.parametrize("case", ["array", "binary", "heads_zero"])
def test_check_cli_refuses_malformed_config_exit_2_one_line(ckpt, case):
    damage, pattern = FILES[case]
    damage(ckpt)
    r = run_cli("mllm_rl.checkpoint", "check", str(ckpt))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ")
    assert str(ckpt / "config.json") in r.stderr

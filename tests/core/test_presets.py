import pytest

from mllm_rl.checkpoint.hf_config import parse_qwen3
from mllm_rl.presets import PRESETS, get_preset


@pytest.mark.parametrize(
    "name,low,high",
    # Published sizes: Qwen3-0.6B 0.6B, 1.7B 1.7B, 4B 4.0B, 8B 8.2B parameters.
    [
        ("qwen3-0.6b", 0.55e9, 0.65e9),
        ("qwen3-1.7b", 1.6e9, 1.8e9),
        ("qwen3-4b", 3.9e9, 4.1e9),
        ("qwen3-8b", 8.1e9, 8.3e9),
    ],
)
def test_qwen3_presets_have_published_sizes(name, low, high):
    assert low < get_preset(name).num_params() < high


def test_hf_config_round_trip():
    for cfg in PRESETS.values():
        back = parse_qwen3(cfg.to_hf_config())
        assert back == cfg


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown preset 'qwen9'.*tiny"):
        get_preset("qwen9")


def test_config_missing_field_names_it():
    cfg = PRESETS["tiny"].to_hf_config()
    del cfg["num_key_value_heads"]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        parse_qwen3(cfg)

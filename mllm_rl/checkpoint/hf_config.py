"""Read a Hugging Face Qwen3 ``config.json`` the way transformers does, or refuse it.

Every field gets transformers' meaning and default, or, when it asks for what our models do not
compute (RoPE scaling, sliding window, biases, ...), a one-line ``ValueError`` naming it. The RoPE
base follows 5.x (``rope_parameters`` over the top-level ``rope_theta``, then 10000); a config
naming two different bases is refused."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mllm_rl.presets import ModelConfig

# Qwen3Config defaults for the fields that do not change the shapes (identical in 4.57 and 5.23).
QWEN3_DEFAULTS: dict[str, Any] = {
    "head_dim": 128,  # not hidden_size // num_attention_heads: Qwen3Config sets 128
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,  # 4.x ``rope_theta``, 5.x ``RotaryEmbeddingConfigMixin.default_theta``
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
}
# Size fields are required although Qwen3Config has (8B-like) defaults: a file without them does
# not describe its weights. ``num_key_value_heads: null`` means MHA, as in transformers.
REQUIRED = tuple(
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads".split()
)
# Checkpoint dtypes both backends load (``torch_dtype`` / 5.x ``dtype``); anything else is refused.
DTYPES = ("float32", "bfloat16", "float16")
SILU = ("silu", "swish")  # transformers' ACT2FN maps both to SiLU
ROPE_KEYS = ("rope_scaling", "rope_parameters")
LAYER_TYPE_KEYS = ("full_attention", "sliding_attention")


def config_from_dir(path: Path) -> ModelConfig:
    """``path/config.json`` (+ ``generation_config.json``'s EOS when config.json has none)."""
    cfg_file = path / "config.json"
    cfg = read_json(cfg_file, required=True)
    gen = read_json(path / "generation_config.json", required=False)
    fallback_eos = gen.get("eos_token_id") if isinstance(gen, dict) else None
    try:
        return parse_qwen3(cfg, name=path.name, fallback_eos=fallback_eos)
    except ValueError as e:
        raise ValueError(f"{cfg_file}: {e}") from None


def read_json(file: Path, required: bool = True) -> Any:
    """Parsed JSON of ``file``; one-line ``ValueError`` naming it (``None`` if absent and optional)."""
    try:
        raw = file.read_bytes()
    except FileNotFoundError:
        if not required:
            return None
        raise ValueError(f"{file}: not found") from None
    except OSError as e:
        raise ValueError(f"{file}: cannot read ({e.strerror or e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{file}: not UTF-8 text (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON ({e.msg} at line {e.lineno})") from None
    except RecursionError:
        raise ValueError(f"{file}: invalid JSON (nested too deeply)") from None


def parse_qwen3(cfg: Any, name: str = "checkpoint", fallback_eos: Any = None) -> ModelConfig:
    """``config.json`` (parsed) -> ``ModelConfig``; ``ValueError("field: why")`` otherwise.
    ``fallback_eos``: ``generation_config.json``'s ``eos_token_id`` (transformers reads it too)."""
    if not isinstance(cfg, dict):
        raise ValueError(f"expected a JSON object, got {_json_type(cfg)}")
    model_type = cfg.get("model_type")
    if model_type not in ("qwen3", None):
        raise ValueError(f"model_type: {model_type!r}, expected 'qwen3'")
    archs = cfg.get("architectures")
    if archs is not None and (not isinstance(archs, list) or set(archs) != {"Qwen3ForCausalLM"}):
        raise ValueError(f"architectures: {archs!r}, expected ['Qwen3ForCausalLM']")
    missing = [k for k in REQUIRED if k not in cfg]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    _check_unsupported(cfg)

    sizes = {k: _positive_int(cfg, k) for k in REQUIRED if k != "num_key_value_heads"}
    heads = sizes["num_attention_heads"]
    kv = heads if cfg["num_key_value_heads"] is None else _positive_int(cfg, "num_key_value_heads")
    if heads % kv:
        raise ValueError(f"num_key_value_heads: {kv} does not divide num_attention_heads {heads}")
    head_dim = _positive_int(cfg, "head_dim", QWEN3_DEFAULTS["head_dim"])
    if head_dim % 2:
        raise ValueError(f"head_dim: {head_dim} is odd (RoPE rotates pairs of dimensions)")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list) or len(layer_types) != sizes["num_hidden_layers"]
    ):
        raise ValueError(
            f"layer_types: expected a list of {sizes['num_hidden_layers']} entries (one per layer)"
        )
    eps = _number(cfg, "rms_norm_eps", QWEN3_DEFAULTS["rms_norm_eps"])
    if eps < 0:
        raise ValueError(f"rms_norm_eps: {eps} is negative")
    tie = cfg.get("tie_word_embeddings", QWEN3_DEFAULTS["tie_word_embeddings"])
    if not isinstance(tie, bool):
        raise ValueError(f"tie_word_embeddings: {tie!r}, expected true or false")
    dtype_key = "dtype" if cfg.get("dtype") else "torch_dtype"  # 5.x writes "dtype"
    dtype = cfg.get(dtype_key) or "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(
            f"{dtype_key}: {dtype!r} is not a dtype we train and serve (accepted: {', '.join(DTYPES)})"
        )
    bos = cfg.get("bos_token_id")
    bos = bos[0] if isinstance(bos, list) and bos else bos
    if bos is not None and not _is_int(bos):
        raise ValueError(f"bos_token_id: {bos!r}, expected an integer")
    return ModelConfig(
        name=str(cfg.get("mllm_rl_preset", name)),
        **sizes,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=_positive_int(
            cfg, "max_position_embeddings", QWEN3_DEFAULTS["max_position_embeddings"]
        ),
        rope_theta=rope_theta(cfg),
        rms_norm_eps=eps,
        tie_word_embeddings=tie,
        torch_dtype=dtype,
        bos_token_id=bos,
        eos_token_id=_eos(cfg, sizes["vocab_size"], fallback_eos),
    )


def rope_theta(cfg: dict[str, Any]) -> float:
    """The RoPE base transformers 5.x computes with (module docstring); refuses ambiguity."""
    dicts = {k: cfg[k] for k in ROPE_KEYS if cfg.get(k)}  # {} and null are "absent" in both versions
    if len(dicts) > 1:
        raise ValueError(
            "rope_scaling and rope_parameters both given (transformers 5.x reads only the first)"
        )
    bases: dict[str, float] = {}
    if "rope_theta" in cfg:
        bases["rope_theta"] = _number(cfg, "rope_theta")
    for key, value in dicts.items():
        for where, rope in _rope_dicts(key, value):
            _check_rope_dict(where, rope)
            if "rope_theta" in rope:
                bases[f"{where}.rope_theta"] = _number(rope, "rope_theta", where=f"{where}.rope_theta")
    for where, base in bases.items():
        if base <= 0:
            raise ValueError(f"{where}: {base} must be > 0")
    if len(set(bases.values())) > 1:
        named = " but ".join(f"{k} = {v:g}" for k, v in bases.items())
        raise ValueError(
            f"{named} (transformers 4.x reads rope_theta, 5.x the RoPE dict: they would build two models)"
        )
    return next(iter(bases.values()), QWEN3_DEFAULTS["rope_theta"])


def _rope_dicts(key: str, value: Any) -> list[tuple[str, dict[str, Any]]]:
    """A flat RoPE dict, or one per layer type (5.x's nested form ``{"full_attention": {...}}``)."""
    if not isinstance(value, dict):
        raise ValueError(f"{key}: {value!r}, expected an object")
    if not any(k in value for k in LAYER_TYPE_KEYS):
        return [(key, value)]
    out = []
    for layer_type, rope in value.items():
        where = f"{key}.{layer_type}"
        if layer_type not in LAYER_TYPE_KEYS:
            raise ValueError(f"{where}: unknown layer type")
        if not isinstance(rope, dict):
            raise ValueError(f"{where}: {rope!r} (layers without RoPE are not implemented)")
        out.append((where, rope))
    return out


def _check_rope_dict(where: str, rope: dict[str, Any]) -> None:
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"{where}: rope_type {rope_type!r} is not implemented (only 'default' RoPE is)")
    _check_partial_rotary(rope, f"{where}.partial_rotary_factor")


def _check_partial_rotary(d: dict[str, Any], where: str) -> None:
    # 4.x's default RoPE honours a top-level partial_rotary_factor, 5.x's Qwen3 RoPE ignores it.
    factor = d.get("partial_rotary_factor")
    if factor is not None and factor != 1:
        raise ValueError(f"{where}: {factor!r} (partial RoPE is not implemented)")


def _check_unsupported(cfg: dict[str, Any]) -> None:
    """Fields whose non-default value makes Qwen3ForCausalLM compute something we do not."""
    act = cfg.get("hidden_act", QWEN3_DEFAULTS["hidden_act"])
    if act not in SILU:
        raise ValueError(f"hidden_act: {act!r} is not implemented (only 'silu' is)")
    if cfg.get("attention_bias", False) is not False:
        raise ValueError(
            f"attention_bias: {cfg['attention_bias']!r} (biased projections are not implemented)"
        )
    dropout = cfg.get("attention_dropout", 0.0)
    if not _is_number(dropout) or dropout != 0:
        raise ValueError(f"attention_dropout: {dropout!r} (dropout is not implemented; 0 required)")
    if cfg.get("use_sliding_window", False) is not False:
        raise ValueError(
            f"use_sliding_window: {cfg['use_sliding_window']!r} (sliding-window attention is not implemented)"
        )
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        other = sorted({str(t) for t in layer_types} - {"full_attention"})
        if other:
            raise ValueError(
                f"layer_types: {', '.join(other)} layers are not implemented (only full_attention)"
            )
    _check_partial_rotary(cfg, "partial_rotary_factor")
    if cfg.get("quantization_config") is not None:
        raise ValueError("quantization_config: quantized checkpoints are not supported")


def _eos(cfg: dict[str, Any], vocab: int, fallback: Any) -> int:
    eos = cfg.get("eos_token_id")
    where = "eos_token_id"
    if eos is None and fallback is not None:
        eos, where = fallback, "generation_config.json eos_token_id"
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        raise ValueError("eos_token_id: missing (in config.json and generation_config.json)")
    if not _is_int(eos) or not 0 <= eos < vocab:
        raise ValueError(f"{where}: {eos!r}, expected a token id in [0, {vocab})")
    return int(eos)


def _positive_int(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default) if default is not None else cfg[key]
    if not _is_int(value):
        raise ValueError(f"{key}: {value!r}, expected a positive integer")
    if value <= 0:
        raise ValueError(f"{key}: {value} must be > 0")
    return int(value)


def _number(cfg: dict[str, Any], key: str, default: float | None = None, where: str | None = None) -> float:
    value = cfg.get(key, default) if default is not None else cfg[key]
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{where or key}: {value!r}, expected a finite number")
    return float(value)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _json_type(x: Any) -> str:
    return {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(x), "a number")

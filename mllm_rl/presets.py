"""Model presets: Qwen3 architecture numbers (the published ``config.json`` files; ``tiny`` is ours,
CPU-fast, its vocab sized for the shipped tokenizer), and the HF ``config.json`` they map to."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Qwen3 dense decoder (HF config names; defaults: the presets' shared values,
    not transformers' ``Qwen3Config`` defaults, ``mllm_rl.checkpoint.hf_config.parse_qwen3``)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 40960
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int = 256  # <|endoftext|> of the shipped tokenizer

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF parameter name -> shape, in checkpoint order (embeddings, layers, norm, head)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_key_value_heads * d
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_hidden_layers):
            p = f"model.layers.{n}."
            shapes.update(
                {
                    p + "input_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (q, h),
                    p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h),
                    p + "self_attn.o_proj.weight": (h, q),
                    p + "self_attn.q_norm.weight": (d,),
                    p + "self_attn.k_norm.weight": (d,),
                    p + "post_attention_layernorm.weight": (h,),
                    p + "mlp.gate_proj.weight": (i, h),
                    p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i),
                }
            )
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in self.param_shapes().values())

    def hf_architecture(self) -> dict[str, Any]:
        """Every ``config.json`` field that decides what ``Qwen3ForCausalLM`` computes, as transformers
        4.x and 5.x both read it (top-level ``rope_theta``, ``rope_scaling: null``, no defaults)."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
        }

    def to_hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of a Hugging Face ``Qwen3ForCausalLM`` checkpoint."""
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            **self.hf_architecture(),
            "torch_dtype": self.torch_dtype,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "mllm_rl_preset": self.name,
        }


# Qwen3 numbers from the published Qwen/Qwen3-*B config.json files.
_QWEN3_VOCAB = 151936
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        name="tiny",
        vocab_size=384,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        # sglang-jax 0.1.0rc0's CPU (native) attention pads head_dim to 128 and then
        # mis-shapes the output for smaller head dims: keep 128, as every Qwen3 has.
        head_dim=128,
        max_position_embeddings=1024,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
        torch_dtype="float32",
    ),
    "qwen3-0.6b": ModelConfig("qwen3-0.6b", _QWEN3_VOCAB, 1024, 3072, 28, 16, 8, 128),
    "qwen3-1.7b": ModelConfig("qwen3-1.7b", _QWEN3_VOCAB, 2048, 6144, 28, 16, 8, 128),
    "qwen3-4b": ModelConfig("qwen3-4b", _QWEN3_VOCAB, 2560, 9728, 36, 32, 8, 128),
    "qwen3-8b": ModelConfig("qwen3-8b", _QWEN3_VOCAB, 4096, 12288, 36, 32, 8, 128, tie_word_embeddings=False),
}


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None

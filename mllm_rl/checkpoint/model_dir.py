"""A Hugging Face–format checkpoint directory, validated before any device memory is touched:
Qwen3 ``config.json``, sound shard index and headers, the expected tensor names, shapes and float
dtypes, tokenizer files, finite weights; one-line ``CheckpointError``s naming file and tensor."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mllm_rl.checkpoint.hf_config import config_from_dir, read_json
from mllm_rl.checkpoint.safetensors_io import (
    SafetensorsError,
    TensorInfo,
    check_finite,
    read_header,
    read_tensor,
)
from mllm_rl.presets import ModelConfig
from mllm_rl.progress import progress_bar

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FLOAT_DTYPES = ("F32", "BF16", "F16")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
PROGRESS_BYTES = 256 * 2**20  # value scans of larger checkpoints show a progress bar


class CheckpointError(ValueError):
    """A checkpoint that must not be loaded; ``str(e)`` is one line naming file/tensor."""


@dataclass(frozen=True)
class ModelDir:
    path: Path
    config: ModelConfig
    tensors: dict[str, tuple[Path, TensorInfo]]  # HF name -> (shard file, info), checkpoint order

    @classmethod
    def open(cls, path: str | Path, check_tokenizer: bool = True, check_values: bool = True) -> ModelDir:
        """Validate and open ``path`` (``check_values``: scan every weight for NaN/inf)."""
        path = Path(path).expanduser().resolve()
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory")
        try:
            config = config_from_dir(path)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        tensors = _read_tensor_table(path)
        _check_names_and_shapes(path, config, tensors)
        if check_tokenizer:
            _check_tokenizer(path, config)
        md = cls(path, config, tensors)
        if check_values:
            md.check_values()
        return md

    def check_values(self, show_progress: bool = True) -> None:
        """``CheckpointError`` naming file and tensor unless every weight is finite."""
        with progress_bar(
            total=self.nbytes,
            desc=f"check {self.path.name}",
            unit="B",
            enabled=show_progress and self.nbytes > PROGRESS_BYTES,
        ) as bar:
            try:
                check_finite(((n, f, i) for n, (f, i) in self.tensors.items()), on_bytes=bar.update)
            except SafetensorsError as e:  # NonFiniteError
                raise CheckpointError(str(e)) from None

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for _, info in self.tensors.values())

    def check_tp(self, tp: int) -> None:
        """``ValueError`` naming ``config.json`` unless ``tp`` divides the (kv) heads."""
        c = self.config
        if c.num_attention_heads % tp or c.num_key_value_heads % tp:
            raise ValueError(
                f"{self.path / 'config.json'}: {c.num_attention_heads} heads / "
                f"{c.num_key_value_heads} kv heads are not divisible by --tp {tp}"
            )

    def iter_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield ``(hf_name, read-only array mapping the file)`` one tensor at a time, in checkpoint
        order; one map per file for the pass (``read_tensor``)."""
        maps: dict[Path, mmap.mmap] = {}
        for name, (file, info) in self.tensors.items():
            yield name, read_tensor(file, info, maps)


def _read_tensor_table(path: Path) -> dict[str, tuple[Path, TensorInfo]]:
    index_file = path / INDEX
    if index_file.exists():
        try:
            index = read_json(index_file)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise CheckpointError(f"{index_file}: invalid index (no weight_map of tensor name -> file name)")
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE).exists():
        weight_map, files = None, [SINGLE]
    else:
        raise CheckpointError(f"{path}: no {SINGLE} and no {INDEX}")
    table: dict[str, tuple[Path, TensorInfo]] = {}
    for fname in files:
        file = path / fname
        if not file.exists():
            raise CheckpointError(f"{file}: listed in {INDEX} but missing")
        try:
            header = read_header(file)
        except SafetensorsError as e:
            raise CheckpointError(str(e)) from None
        for name, info in header.items():
            if weight_map is not None and weight_map.get(name) != fname:
                raise CheckpointError(f"{file}: tensor {name}: not mapped to this file in {INDEX}")
            table[name] = (file, info)
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in table:
                raise CheckpointError(f"{path / fname}: tensor {name}: listed in {INDEX} but absent")
    return table


def _check_names_and_shapes(
    path: Path, config: ModelConfig, tensors: dict[str, tuple[Path, TensorInfo]]
) -> None:
    expected = config.param_shapes()
    for name, shape in expected.items():
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name}: missing (config.json expects it)")
        file, info = tensors[name]
        if info.shape != shape:
            raise CheckpointError(
                f"{file}: tensor {name}: shape {list(info.shape)}, config.json implies {list(shape)}"
            )
        if info.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"{file}: tensor {name}: dtype {info.dtype}, expected a float dtype")
    extra = [n for n in tensors if n not in expected]
    if extra:
        file, _ = tensors[extra[0]]
        raise CheckpointError(f"{file}: tensor {extra[0]}: unexpected for this config.json")
    dtypes = {info.dtype for _, info in tensors.values()}
    if len(dtypes) > 1:
        raise CheckpointError(f"{path}: mixed tensor dtypes {sorted(dtypes)}")


def _check_tokenizer(path: Path, config: ModelConfig) -> None:
    for fname in TOKENIZER_FILES:
        if not (path / fname).exists():
            raise CheckpointError(f"{path / fname}: tokenizer file missing")
    try:
        tok = read_json(path / "tokenizer.json")
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    model = tok.get("model") if isinstance(tok, dict) else None
    if not isinstance(model, dict) or not isinstance(tok.get("added_tokens", []), list):
        raise CheckpointError(f"{path / 'tokenizer.json'}: not a tokenizers JSON (no model object)")
    vocab = len(model.get("vocab") or {}) + len(tok.get("added_tokens", []))
    if vocab > config.vocab_size:
        raise CheckpointError(
            f"{path / 'tokenizer.json'}: {vocab} tokens exceed config vocab_size {config.vocab_size}"
        )

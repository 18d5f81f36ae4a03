"""Write a random-weight Hugging Face–format Qwen3 checkpoint from a preset (memory does not depend
on the values; ``tiny``'s peaked logits keep greedy decoding stable across implementations)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from mllm_rl.checkpoint.model_dir import INDEX
from mllm_rl.checkpoint.safetensors_io import DTYPES, write_file
from mllm_rl.options.check import check_names, check_output_dir
from mllm_rl.presets import ModelConfig
from mllm_rl.progress import progress_bar

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
_DTYPE_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def init_tensor(shape: tuple[int, ...], seed: int, index: int) -> np.ndarray:
    """Deterministic float32 init: norm scales ones, matrices N(0, 1/fan_in) (unit-scale activations)."""
    if len(shape) == 1:
        return np.ones(shape, np.float32)
    rng = np.random.default_rng([seed, index])
    return rng.standard_normal(shape, dtype=np.float32) * np.float32(1.0 / math.sqrt(shape[1]))  # fan_in


def make_checkpoint(
    config: ModelConfig,
    out: str | Path,
    dtype: str | None = None,
    seed: int = 0,
    shard_bytes: int = 2 * 1024**3,
    show_progress: bool = True,
    force: bool = False,
) -> Path:
    """Write ``config.json``, sharded safetensors + index and the shipped tokenizer into ``out``; a
    non-empty ``out`` is refused (``ValueError``) unless it holds the same checkpoint or ``force``
    replaces another checkpoint."""
    dtype = dtype or config.torch_dtype
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(_DTYPE_NAMES)}")
    st_dtype = _DTYPE_NAMES[dtype]
    np_dtype = DTYPES[st_dtype]
    out = Path(out).expanduser().resolve()
    hf = config.to_hf_config()
    hf["torch_dtype"] = dtype
    hf["mllm_rl_seed"] = seed  # with the preset and the dtype: which weights these are
    _check_out(out, hf, force)
    out.mkdir(parents=True, exist_ok=True)

    shapes = config.param_shapes()
    itemsize = np_dtype.itemsize
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = int(np.prod(shape)) * itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    order = {name: i for i, name in enumerate(shapes)}
    total = sum(int(np.prod(s)) * itemsize for s in shapes.values())

    def make_fn(name: str):
        return lambda: init_tensor(shapes[name], seed, order[name]).astype(np_dtype)

    weight_map: dict[str, str] = {}
    with progress_bar(total=total, desc=f"write {config.name}", unit="B", enabled=show_progress) as bar:
        for i, names in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            entries = [(n, shapes[n], st_dtype, make_fn(n)) for n in names]
            write_file(out / fname, entries, on_bytes=bar.update)
            weight_map.update({n: fname for n in names})
    for stale in out.glob("*.safetensors"):
        if stale.name not in set(weight_map.values()):
            stale.unlink()
    (out / INDEX).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (out / "config.json").write_text(json.dumps(hf, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": config.eos_token_id, "do_sample": False}, indent=2)
    )
    for f in TOKENIZER_DIR.iterdir():
        shutil.copy2(f, out / f.name)
    return out


def _check_out(out: Path, want: dict[str, Any], force: bool) -> None:
    """``ValueError`` unless ``make_checkpoint`` may write ``want`` (its config) into ``out``."""
    check_names(out, "--out")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory; choose another --out")
    check_output_dir(out, "--out")
    if not out.exists() or not any(out.iterdir()):
        return
    cfg_file = out / "config.json"
    if not cfg_file.is_file():
        raise ValueError(
            f"{out}: exists and is not a checkpoint directory; refusing to overwrite (choose another --out)"
        )
    try:
        have = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        have = None
    if have == want or force:
        return
    raise ValueError(
        f"{out}: holds a different checkpoint ({_difference(have, want)}); "
        "pass --force to replace it or choose another --out"
    )


def _difference(have: Any, want: dict[str, Any]) -> str:
    """What differs between the ``config.json`` there and the one to write, briefly."""
    if not isinstance(have, dict):
        return "its config.json is not a JSON object of ours"
    first = ["mllm_rl_preset", "torch_dtype", "mllm_rl_seed"]  # the make flags, then the rest
    keys = first + sorted(k for k in {*have, *want} if k not in first)
    diff = [k for k in keys if have.get(k, _UNSET) != want.get(k, _UNSET)]
    shown = [f"{k} {_show(have.get(k, _UNSET))} there, {_show(want.get(k, _UNSET))} asked" for k in diff[:3]]
    more = f", and {len(diff) - 3} more field(s)" if len(diff) > 3 else ""
    return "config.json: " + "; ".join(shown) + more


_UNSET = object()


def _show(value: Any) -> str:
    return "unset" if value is _UNSET else json.dumps(value)

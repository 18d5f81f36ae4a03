"""Turn ``--model PRESET|DIR|HUB_ID`` into a validated local checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path

from mllm_rl.checkpoint.make import make_checkpoint
from mllm_rl.checkpoint.model_dir import CheckpointError, ModelDir
from mllm_rl.presets import PRESETS


def cache_dir() -> Path:
    """``$MLLM_RL_CACHE`` or ``~/.cache/mllm_rl``: where preset checkpoints are written."""
    return Path(os.environ.get("MLLM_RL_CACHE", Path.home() / ".cache" / "mllm_rl")).expanduser()


def resolve_model(spec: str, seed: int = 0, dtype: str | None = None) -> ModelDir:
    """Return an opened, validated checkpoint for a preset name, a local dir, or a hub id.

    Presets are written once to ``cache_dir()/checkpoints/<preset>-<dtype>-s<seed>``; a hub
    id is downloaded only when online (``HF_HUB_OFFLINE`` unset). Raises ``CheckpointError``.
    """
    if spec in PRESETS:
        cfg = PRESETS[spec]
        dt = dtype or cfg.torch_dtype
        out = cache_dir() / "checkpoints" / f"{spec}-{dt}-s{seed}"
        try:
            return ModelDir.open(out)
        except CheckpointError:
            make_checkpoint(cfg, out, dtype=dt, seed=seed)
            return ModelDir.open(out, check_values=False)  # values just drawn: finite by construction
    path = Path(spec).expanduser()
    if path.exists() or spec.startswith((".", "/", "~")):
        return ModelDir.open(path)
    if spec.count("/") != 1:
        raise CheckpointError(
            f"{spec}: not a preset ({', '.join(PRESETS)}), not an existing directory, not a hub id"
        )
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", ""):
        raise CheckpointError(f"{spec}: hub download needed but HF_HUB_OFFLINE is set")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(
            f"{spec}: hub download needs huggingface_hub (pip install huggingface_hub)"
        ) from None
    try:
        local = snapshot_download(spec, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.jinja"])
    except Exception as e:  # network/auth errors come in many types
        raise CheckpointError(f"{spec}: hub download failed ({type(e).__name__}: {e})") from None
    return ModelDir.open(local)

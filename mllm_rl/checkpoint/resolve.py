"""Resolve what a run loads: ``--model PRESET|DIR|HUB_ID`` into a validated checkpoint directory,
``--resume`` into the newest RL checkpoint whose files match its manifest (sizes and sha256)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mllm_rl.checkpoint.make import make_checkpoint
from mllm_rl.checkpoint.model_dir import CheckpointError, ModelDir
from mllm_rl.presets import PRESETS


def cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """``$MLLM_RL_CACHE`` or ``~/.cache/mllm_rl``: preset checkpoints, JAX's compiled programs and
    the memory planners' figures."""
    return Path(env.get("MLLM_RL_CACHE", Path.home() / ".cache" / "mllm_rl")).expanduser()


def resolve_model(spec: str, seed: int = 0, dtype: str | None = None) -> ModelDir:
    """An opened, validated checkpoint of a preset (cached under ``cache_dir()``), a local dir or a
    hub id (downloaded unless ``HF_HUB_OFFLINE``); ``CheckpointError``."""
    if spec in PRESETS:
        cfg = PRESETS[spec]
        dt = dtype or cfg.torch_dtype
        out = cache_dir() / "checkpoints" / f"{spec}-{dt}-s{seed}"
        try:
            return ModelDir.open(out)
        except CheckpointError:
            make_checkpoint(cfg, out, dtype=dt, seed=seed, force=True)  # the cache's own directory
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


# -- RL checkpoints (``RUN_DIR/checkpoints/step_<k>``): written with a manifest, verified before use --
CKPT_DIR = "checkpoints"
META = "meta.json"
STEP_DIR = re.compile(r"^step_(\d+)$")
HASH_CHUNK = 8 * 2**20


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_manifest(ckpt: Path, known: Mapping[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes", "sha256"}}`` of every file under ``ckpt`` but ``meta.json``:
    ``known`` entries (hashed while written) where the size agrees, the rest hashed in parallel."""
    known = known or {}
    files = sorted(p for p in ckpt.rglob("*") if p.is_file() and not p.name.startswith(META))
    rels = [str(p.relative_to(ckpt)) for p in files]
    sizes = [p.stat().st_size for p in files]
    todo = [p for p, rel, n in zip(files, rels, sizes, strict=True) if known.get(rel, {}).get("bytes") != n]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = dict(zip(todo, pool.map(_sha256, todo), strict=True))
    return {
        rel: {"bytes": n, "sha256": digests[p] if p in digests else known[rel]["sha256"]}
        for p, rel, n in zip(files, rels, sizes, strict=True)
    }


# what a filesystem that cannot sync a file or a directory says (some FUSE and network ones)
UNSYNCABLE = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})


def _fsync(path: Path, directory: bool = False) -> None:
    """``fsync`` ``path``; an error names it (``OSError.filename``). Where the filesystem cannot
    sync (``UNSYNCABLE``) nothing more can be done, so that is not an error."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    except FileNotFoundError:  # another process's temporary file, renamed since: its writer syncs it
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in UNSYNCABLE:
            raise OSError(e.errno, e.strerror, str(path)) from None
    finally:
        os.close(fd)


def sync_tree(root: Path) -> float:
    """``fsync`` every file under ``root`` (in parallel), then every directory, deepest first, so
    files and names are on disk before a manifest counts them; the seconds it took."""
    t0 = time.perf_counter()
    files = [p for p in root.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(files)))) as pool:
        list(pool.map(_fsync, files))
    dirs = sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
    for d in [*dirs, root]:
        _fsync(d, directory=True)
    return time.perf_counter() - t0


def write_meta(
    ckpt: Path, meta: dict[str, Any], known: Mapping[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Write ``ckpt/meta.json`` = ``meta`` + the files' manifest, atomically and durably (the
    checkpoint counts from the rename on); what was written."""
    t0 = time.perf_counter()
    files = file_manifest(ckpt, known)
    full = {**meta, "files": files, "manifest_s": round(time.perf_counter() - t0, 4)}
    tmp = ckpt / f"{META}.tmp"
    tmp.write_text(json.dumps(full, indent=1))
    _fsync(tmp)
    os.replace(tmp, ckpt / META)
    _fsync(ckpt, directory=True)
    _fsync(ckpt.parent, directory=True)  # the step directory's own name
    return full


@dataclass(frozen=True)
class RLCheckpoint:
    step: int
    path: Path
    meta: dict[str, Any]
    verified: bool  # False: no manifest (sizes and checksums unknown)


def verify_rl_checkpoint(ckpt: Path, expect: Mapping[str, Any] | None = None) -> RLCheckpoint:
    """The checkpoint in ``ckpt`` if its ``meta.json`` is valid, agrees with ``expect`` and every
    file it lists has its size and sha256; else ``CheckpointError`` naming the file."""
    meta_path = ckpt / META
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path}: missing (a save that did not finish)")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: not valid JSON ({e})") from None
    step = meta.get("step") if isinstance(meta, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{meta_path}: expected an object with a non-negative integer 'step'")
    for key, want in (expect or {}).items():
        if key in meta and meta[key] != want:
            raise CheckpointError(f"{meta_path}: written with {key} {meta[key]!r}, this run has {want!r}")
    files = meta.get("files")
    if files is None:
        return RLCheckpoint(step, ckpt, meta, verified=False)
    if not isinstance(files, dict) or not files:
        raise CheckpointError(f"{meta_path}: 'files' must map each file to its bytes and sha256")
    for rel, want in files.items():
        path = ckpt / rel
        if not isinstance(want, dict) or not {"bytes", "sha256"} <= set(want):
            raise CheckpointError(f"{meta_path}: files[{rel!r}]: expected bytes and sha256")
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"{path}: {size} bytes, {META} says {want['bytes']} (truncated or rewritten)"
            )
        if _sha256(path) != want["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from {META} (corrupt)")
    return RLCheckpoint(step, ckpt, meta, verified=True)


def rl_checkpoint_dirs(run_dir: Path) -> list[Path]:
    """``RUN_DIR/checkpoints/step_<k>`` directories, newest (largest k) first."""
    root = Path(run_dir) / CKPT_DIR
    found = [
        (int(m.group(1)), d) for d in root.glob("step_*") if (m := STEP_DIR.match(d.name)) and d.is_dir()
    ]
    return [d for _, d in sorted(found, reverse=True)]


def find_resumable(
    run_dir: Path, expect: Mapping[str, Any] | None = None
) -> tuple[RLCheckpoint | None, list[tuple[Path, str]]]:
    """The newest valid RL checkpoint of ``run_dir``, and the newer ones skipped with the reason."""
    skipped: list[tuple[Path, str]] = []
    for d in rl_checkpoint_dirs(run_dir):
        try:
            return verify_rl_checkpoint(d, expect), skipped
        except CheckpointError as e:
            skipped.append((d, str(e)))
    return None, skipped

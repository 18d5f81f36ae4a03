"""RL checkpoints: a manifest (sizes, sha256) written with each, verified before ``--resume`` uses it.

The checkpoint directories here hold plain files standing in for a trainer's state (what the
verification reads); the real trainers' checkpoints are saved, corrupted and resumed end to end in
tests/jax/test_rl_run.py and tests/torch/test_rl_run.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mllm_rl.checkpoint.model_dir import CheckpointError
from mllm_rl.checkpoint.resolve import find_resumable, rl_checkpoint_dirs, verify_rl_checkpoint, write_meta
from mllm_rl.plans.preflight import resolve_resume
from mllm_rl.plans.rl import RLOptions, _saver


def ckpt(run_dir: Path, step: int, manifest: bool = True, **meta) -> Path:
    d = run_dir / "checkpoints" / f"step_{step:06d}"
    (d / "state" / "sub").mkdir(parents=True)
    (d / "state" / "params.bin").write_bytes(os.urandom(5000))
    (d / "state" / "sub" / "opt.bin").write_bytes(os.urandom(300))
    if manifest:
        write_meta(d, {"step": step, "backend": "jax", "lora_rank": 0, **meta})
    else:  # a checkpoint written before manifests existed
        (d / "meta.json").write_text(json.dumps({"step": step, "seed": 0}))
    return d


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    d = ckpt(tmp_path, 3)
    meta = json.loads((d / "meta.json").read_text())
    assert set(meta["files"]) == {"state/params.bin", "state/sub/opt.bin"}
    assert meta["files"]["state/params.bin"]["bytes"] == 5000
    assert len(meta["files"]["state/sub/opt.bin"]["sha256"]) == 64
    got = verify_rl_checkpoint(d, {"backend": "jax", "lora_rank": 0})
    assert (got.step, got.path, got.verified) == (3, d, True)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda d: os.truncate(d / "state" / "params.bin", 10), "params.bin: 10 bytes, meta.json says 5000"),
        (lambda d: flip_byte(d / "state" / "sub" / "opt.bin"), "opt.bin: sha256 differs from meta.json"),
        (lambda d: (d / "state" / "params.bin").unlink(), "params.bin: missing"),
        (lambda d: (d / "meta.json").unlink(), "meta.json: missing (a save that did not finish)"),
        (lambda d: (d / "meta.json").write_text('{"step": 3, "fil'), "meta.json: not valid JSON"),
        (lambda d: (d / "meta.json").write_bytes(b"\xff\xfe\x00"), "meta.json: not valid JSON"),
        (lambda d: (d / "meta.json").write_text('{"step": -1}'), "non-negative integer 'step'"),
        (lambda d: (d / "meta.json").write_text("[1, 2]"), "non-negative integer 'step'"),
        (lambda d: (d / "meta.json").write_text('{"step": 3, "files": {}}'), "'files' must map"),
    ],
)
def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path, damage, message):
    d = ckpt(tmp_path, 3)
    damage(d)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
        verify_rl_checkpoint(d)


def test_a_checkpoint_another_run_could_not_load_is_refused(tmp_path):
    d = ckpt(tmp_path, 3)
    with pytest.raises(CheckpointError, match="written with lora_rank 0, this run has 8"):
        verify_rl_checkpoint(d, {"backend": "jax", "lora_rank": 8})
    with pytest.raises(CheckpointError, match="written with backend 'jax', this run has 'torch'"):
        verify_rl_checkpoint(d, {"backend": "torch", "lora_rank": 0})


def test_the_newest_valid_checkpoint_wins_and_the_skipped_ones_are_named(tmp_path):
    ckpt(tmp_path, 8)
    ckpt(tmp_path, 9)
    bad = ckpt(tmp_path, 10)  # numerically newest (step_000010 > step_000009)
    os.truncate(bad / "state" / "params.bin", 1)
    (tmp_path / "checkpoints" / "step_xyz").mkdir()  # not a checkpoint name: ignored
    assert [d.name for d in rl_checkpoint_dirs(tmp_path)] == ["step_000010", "step_000009", "step_000008"]
    found, skipped = find_resumable(tmp_path)
    assert found.step == 9
    assert [(d.name, "1 bytes" in why) for d, why in skipped] == [("step_000010", True)]


def test_legacy_checkpoints_without_a_manifest_are_used_unverified_and_said_so(tmp_path):
    ckpt(tmp_path, 4, manifest=False)
    found, lines = resolve_resume(tmp_path, {"backend": "jax"}, or_start=False)
    assert found.step == 4 and not found.verified
    assert lines == ["resume: step_000004 has no file manifest (written before checksums): not verified"]


def test_resume_targets(tmp_path):
    with pytest.raises(CheckpointError, match="no such run directory"):
        resolve_resume(tmp_path / "typo", {}, or_start=False)
    assert resolve_resume(tmp_path / "typo", {}, or_start=True) == (None, [])
    with pytest.raises(CheckpointError, match="nothing to resume"):
        resolve_resume(tmp_path, {}, or_start=False)
    assert resolve_resume(tmp_path, {}, or_start=True) == (None, [])
    d = ckpt(tmp_path, 1)
    os.truncate(d / "state" / "params.bin", 0)
    for or_start in (False, True):  # checkpoints that are all invalid are never silently started over
        with pytest.raises(
            CheckpointError, match="no valid checkpoint in .*step_000001: .*params.bin: 0 bytes"
        ):
            resolve_resume(tmp_path, {}, or_start=or_start)
    ckpt(tmp_path, 0)
    found, lines = resolve_resume(tmp_path, {}, or_start=False)
    assert found.step == 0 and len(lines) == 1 and lines[0].startswith("resume: skipped step_000001: ")


class StateWriter:
    """Stands in for a trainer's ``save`` (the saver's contract: it writes files into the directory)."""

    def save(self, path: Path) -> None:
        (path / "state.bin").write_bytes(os.urandom(1000))


def test_saver_keeps_its_cadence_the_last_step_and_two_verified_checkpoints(tmp_path):
    opts = RLOptions(steps=7, checkpoint_every=3)
    save = _saver(StateWriter(), tmp_path, "jax", opts)
    saved = [step for step in range(7) if save(step) is not None]
    assert saved == [2, 5, 6]  # every 3rd step, and the last
    assert [d.name for d in rl_checkpoint_dirs(tmp_path)] == ["step_000006", "step_000005"]
    for d in rl_checkpoint_dirs(tmp_path):
        assert verify_rl_checkpoint(d, {"backend": "jax", "lora_rank": 0}).verified
    assert [
        s
        for s in range(3)
        if _saver(StateWriter(), tmp_path, "jax", RLOptions(steps=3, checkpoint_every=0))(s)
    ] == []

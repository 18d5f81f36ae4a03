"""RL checkpoints: a manifest (sizes, sha256) written with each, verified before ``--resume`` uses it.

The checkpoint directories here hold plain files standing in for a trainer's state (what the
verification reads); the real trainers' checkpoints are saved, corrupted and resumed end to end in
tests/jax/test_rl_run.py and tests/torch/test_rl_run.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mllm_rl.checkpoint.model_dir import CheckpointError
from mllm_rl.checkpoint.resolve import find_resumable, rl_checkpoint_dirs, verify_rl_checkpoint, write_meta
from mllm_rl.plans.preflight import resolve_resume
from mllm_rl.plans.rl import RLOptions, checkpointer
from tests.fakes import FakeDevice, FakeTrainer, fingerprint, nbytes


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


def test_the_manifest_takes_a_hash_made_while_writing_only_for_a_file_of_its_size(tmp_path):
    """``known`` entries (a trainer hashed the file as it wrote it) are taken without reading the file
    back; one whose size is not the file's is hashed again."""
    d = tmp_path / "step_000000"
    (d / "state").mkdir(parents=True)
    (d / "state" / "a.bin").write_bytes(b"a" * 100)
    (d / "state" / "b.bin").write_bytes(b"b" * 50)
    known = {
        "state/a.bin": {"bytes": 100, "sha256": "f" * 64},
        "state/b.bin": {"bytes": 49, "sha256": "e" * 64},
    }
    files = write_meta(d, {"step": 0}, known)["files"]
    assert files["state/a.bin"] == {"bytes": 100, "sha256": "f" * 64}  # taken: not read back
    assert files["state/b.bin"] == {"bytes": 50, "sha256": hashlib.sha256(b"b" * 50).hexdigest()}


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
    """Stands in for a trainer's ``save`` (the saver's contract: it writes files into the directory);
    it has no ``snapshot``: it saves only in place."""

    def save(self, path: Path) -> None:
        (path / "state.bin").write_bytes(os.urandom(1000))

    def snapshot(self, path: Path | None = None) -> None:
        return None


def saver(trainer, run_dir: Path, steps: int, every: int, background: bool = True):
    return checkpointer(trainer, run_dir, "jax", RLOptions(steps=steps, checkpoint_every=every), background)


def test_saver_keeps_its_cadence_the_last_step_and_two_verified_checkpoints(tmp_path):
    save = saver(StateWriter(), tmp_path, steps=7, every=3)
    infos = [save(step) for step in range(7)]
    assert [s for s, i in enumerate(infos) if i["saved"]] == [2, 5, 6]  # every 3rd step, and the last
    assert [i["path"] is not None for i in infos] == [i["saved"] for i in infos]
    assert [d.name for d in rl_checkpoint_dirs(tmp_path)] == ["step_000006", "step_000005"]
    for d in rl_checkpoint_dirs(tmp_path):
        assert verify_rl_checkpoint(d, {"backend": "jax", "lora_rank": 0}).verified
    never = saver(StateWriter(), tmp_path / "never", steps=3, every=0)
    assert [never(s)["saved"] for s in range(3)] == [False] * 3
    assert not (tmp_path / "never").exists()


def _weights_of(path: Path) -> dict[str, np.ndarray]:
    with np.load(path / "weights.npz") as f:
        return {n: f[n].copy() for n in f.files}


def test_a_background_write_counts_only_once_written_and_holds_the_state_of_its_step(tmp_path):
    """The phase returns while the write waits (no meta.json: not resumable yet, not recorded as
    saved); the trainer trains on; the checkpoint, once written, holds the snapshot's weights."""
    gate = threading.Event()
    trainer = FakeTrainer(FakeDevice(), snapshot_gate=gate)
    save = saver(trainer, tmp_path, steps=2, every=1)
    info = save(0)
    assert (info["saved"], info["background"], info["snapshot_bytes"]) == (
        False,
        True,
        nbytes(trainer.weights),
    )
    d = Path(info["path"])
    assert find_resumable(tmp_path)[0] is None  # begun, not written: a kill now loses it
    at_step_0 = {n: w.copy() for n, w in trainer.weights.items()}
    for w in trainer.weights.values():  # the next step trains while the write is pending
        w += 1.0
    gate.set()
    written = save.flush()
    assert [(w["step"], w["path"]) for w in written] == [(0, str(d))] and written[0]["bytes"] == info[
        "snapshot_bytes"
    ]
    assert verify_rl_checkpoint(d, {"backend": "jax"}).verified
    assert fingerprint(_weights_of(d)) == fingerprint(at_step_0) != fingerprint(trainer.weights)
    assert save.flush() == []  # nothing left to wait for


def test_a_due_save_waits_for_the_write_before_it_and_records_it(tmp_path):
    gate = threading.Event()
    save = saver(FakeTrainer(FakeDevice(), snapshot_gate=gate), tmp_path, steps=4, every=2)
    assert save(1)["background"]
    assert "written" not in save(2)  # not due: does not wait, the write is still running
    threading.Timer(0.3, gate.set).start()
    t0 = time.perf_counter()
    info = save(3)  # due: one write at a time
    assert time.perf_counter() - t0 >= 0.25
    assert [w["step"] for w in info["written"]] == [1] and info["background"]
    assert [w["step"] for w in save.flush()] == [3]
    assert [d.name for d in rl_checkpoint_dirs(tmp_path)] == ["step_000003", "step_000001"]


def test_without_a_snapshot_or_without_background_the_phase_writes_the_checkpoint(tmp_path):
    for trainer, background in ((FakeTrainer(FakeDevice(), snapshots=False), True),
                                (FakeTrainer(FakeDevice()), False)):  # fmt: skip
        run = tmp_path / str(background)
        info = saver(trainer, run, steps=1, every=1, background=background)(0)
        assert info["saved"] and "background" not in info
        assert find_resumable(run)[0].step == 0


class FailingSnapshot:
    nbytes = 8

    def write(self, path: Path) -> None:
        (path / "weights.npz").write_bytes(b"part")
        raise OSError(28, "No space left on device")


class FailingWriter(StateWriter):
    def snapshot(self, path: Path | None = None) -> FailingSnapshot:
        return FailingSnapshot()


def test_a_failed_background_write_raises_where_collected_and_leaves_nothing_resumable(tmp_path):
    save = saver(FailingWriter(), tmp_path, steps=2, every=1)
    assert save(0)["background"]
    with pytest.raises(OSError, match="No space left"):
        save(1)
    assert find_resumable(tmp_path)[0] is None
    save = saver(FailingWriter(), tmp_path / "abandoned", steps=2, every=1)
    save(0)
    save.abandon()  # after another failure: waits, does not raise over it
    assert save.flush() == []


def test_a_setting_resume_overrides_does_not_disqualify_the_checkpoint(tmp_path):
    """``--resume --seed 5 --override seed``: the checkpoint written with seed 0 is the one resumed
    (the change is accepted); without ``--override`` it is refused, naming the seed."""
    from types import SimpleNamespace

    from mllm_rl.plans.rl import RLPlan

    ckpt(tmp_path, 0, seed=0, precision="mixed")
    opts = RLOptions(steps=2, seed=5)
    backend = SimpleNamespace(name="jax")
    args = SimpleNamespace(resume=True, resume_or_start=False, override=["seed"])
    got, notes = RLPlan().preflight(args, opts, backend, tmp_path)
    assert got.resume_from is not None and got.resume_from.step == 0 and got.seed == 5, notes
    with pytest.raises(CheckpointError, match="written with seed 0, this run has 5"):
        RLPlan().preflight(SimpleNamespace(**{**vars(args), "override": []}), opts, backend, tmp_path)

"""Checkpoint failures said in one line: RL checkpoint writes the OS refuses (``CheckpointWriteError``,
the unfinished checkpoint removed, the older ones kept), ``python -m mllm_rl.checkpoint make``
refusing to overwrite another checkpoint, and model dtypes we cannot train or serve. Whole runs
whose checkpoint write hits a real ``RLIMIT_FSIZE``: on the fake backend here (``tests/fake_run.py``),
with each backend's own writer in tests/jax and tests/torch."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from mllm_rl.checkpoint import CheckpointError, ModelDir, make_checkpoint
from mllm_rl.checkpoint import writer as writer_mod
from mllm_rl.checkpoint.hf_config import parse_qwen3
from mllm_rl.checkpoint.resolve import find_resumable, rl_checkpoint_dirs, verify_rl_checkpoint
from mllm_rl.checkpoint.writer import Checkpointer, CheckpointWriteError
from mllm_rl.presets import get_preset
from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import ROOT, run_cli

META = {"backend": "jax", "lora_rank": 0}


def tree(d: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``d`` (directories as "dir")."""
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(d.rglob("*"))
    }


class Trainer:
    """Writes ``state/a.bin`` and ``state/b.bin`` (64 KiB each); at a step in ``fail``, ``b.bin`` is
    refused after half of it was written, as a file-size limit refuses it. ``snapshots``: writes in
    the background (each write waits for ``gate`` first)."""

    def __init__(self, fail: dict[int, str] | None = None, snapshots: bool = False) -> None:
        self.fail, self.snapshots = fail or {}, snapshots
        self.gate = threading.Event()
        self.gate.set()

    def save(self, path: Path) -> None:
        (path / "state").mkdir()
        (path / "state" / "a.bin").write_bytes(os.urandom(65536))
        b = path / "state" / "b.bin"
        how = self.fail.get(int(path.name.removeprefix("step_")))
        if how is None:
            b.write_bytes(os.urandom(65536))
            return
        b.write_bytes(os.urandom(32768))
        if how == "file":  # as open()/write() and the backends' writers report it
            raise OSError(errno.EFBIG, os.strerror(errno.EFBIG), str(b))
        raise OSError(errno.EFBIG, os.strerror(errno.EFBIG))  # no file named

    def snapshot(self, path: Path | None = None) -> Snapshot | None:
        return Snapshot(self) if self.snapshots else None


class Snapshot:
    nbytes = 131072

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def write(self, path: Path) -> None:
        self.trainer.gate.wait()
        self.trainer.save(path)


def saver(trainer: Trainer, run_dir: Path, background: bool = False) -> Checkpointer:
    return Checkpointer(trainer, run_dir, META, every=1, steps=4, keep=2, background=background)


def only_complete_checkpoints(run_dir: Path, steps: list[int]) -> None:
    """``checkpoints/`` holds exactly ``step_<k>`` for ``steps``, each verified; nothing else (no
    unfinished checkpoint, no temporary file or directory)."""
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == [f"step_{s:06d}" for s in sorted(steps)]
    assert not [p for p in root.rglob("*") if "tmp" in p.name], sorted(root.rglob("*"))
    for d in rl_checkpoint_dirs(run_dir):
        assert verify_rl_checkpoint(d, META).verified


# -- writes the OS refuses ---------------------------------------------------------------------
def test_the_error_is_a_runtime_error_not_bad_input():
    assert issubclass(CheckpointWriteError, RuntimeError)  # python -m mllm_rl.run: exit 1
    assert not issubclass(CheckpointWriteError, ValueError)  # exit 2 says "bad input"
    e = CheckpointWriteError("checkpoint step_000001: writing /x: File too large", errno.EFBIG, "/x")
    assert str(e) == "checkpoint step_000001: writing /x: File too large" and e.errno == errno.EFBIG


@pytest.mark.parametrize("how", ["file", "no_file"])
def test_a_refused_write_is_one_line_and_the_older_checkpoints_stay_resumable(tmp_path, how):
    save = saver(Trainer(fail={2: how}), tmp_path)
    assert save(0)["saved"] and save(1)["saved"]
    before = tree(tmp_path / "checkpoints")
    with pytest.raises(CheckpointWriteError) as e:
        save(2)
    ckpt = tmp_path / "checkpoints" / "step_000002"
    where = ckpt / "state" / "b.bin" if how == "file" else ckpt
    assert str(e.value) == f"checkpoint step_000002: writing {where}: File too large"
    assert e.value.errno == errno.EFBIG and e.value.__cause__ is None
    only_complete_checkpoints(tmp_path, [0, 1])
    assert tree(tmp_path / "checkpoints") == before  # the older ones untouched, not pruned
    resumable, skipped = find_resumable(tmp_path, META)
    assert resumable is not None and resumable.step == 1 and skipped == []


def test_a_refused_manifest_is_the_same_error(tmp_path, monkeypatch):
    save = saver(Trainer(), tmp_path)
    save(0)

    def full_disk(path: Path, meta: dict, known: dict | None = None) -> dict:
        tmp = path / "meta.json.tmp"
        tmp.write_text("{")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    monkeypatch.setattr(writer_mod, "write_meta", full_disk)
    with pytest.raises(CheckpointWriteError, match=r"^checkpoint step_000001: writing .*step_000001/meta\.json\.tmp: No space left on device$"):  # fmt: skip
        save(1)
    only_complete_checkpoints(tmp_path, [0])


def test_a_checkpoints_directory_that_cannot_be_created_is_the_same_error(tmp_path):
    (tmp_path / "checkpoints").write_text("a file where the directory belongs")
    with pytest.raises(
        CheckpointWriteError, match=r"^checkpoint step_000000: writing .*checkpoints/step_000000: "
    ):
        saver(Trainer(), tmp_path)(0)


def test_a_background_write_refused_raises_on_the_main_thread_where_collected(tmp_path):
    trainer = Trainer(fail={1: "file"}, snapshots=True)
    save = saver(trainer, tmp_path, background=True)
    assert save(0)["background"]
    assert [w["step"] for w in save.flush()] == [0]
    trainer.gate.clear()
    info = save(1)  # the phase returns while the write waits
    assert info["background"] and not info["saved"]
    trainer.gate.set()
    with pytest.raises(CheckpointWriteError) as e:
        save(2)  # the next due checkpoint collects the failed write first, and begins nothing
    b = tmp_path / "checkpoints" / "step_000001" / "state" / "b.bin"
    assert str(e.value) == f"checkpoint step_000001: writing {b}: File too large"
    only_complete_checkpoints(tmp_path, [0])
    assert save.flush() == []  # raised once

    trainer = Trainer(fail={0: "file"}, snapshots=True)
    save = saver(trainer, tmp_path / "flush", background=True)
    save(0)
    with pytest.raises(
        CheckpointWriteError, match="^checkpoint step_000000: writing .*b.bin: File too large$"
    ):
        save.flush()  # the run's checkpoint_flush phase
    assert list((tmp_path / "flush" / "checkpoints").iterdir()) == []


def test_an_interrupted_write_leaves_no_unfinished_checkpoint(tmp_path):
    class Interrupted(Trainer):
        def save(self, path: Path) -> None:
            (path / "state").mkdir()
            raise KeyboardInterrupt

    save = saver(Trainer(), tmp_path)
    save(0)
    save = saver(Interrupted(), tmp_path)
    with pytest.raises(KeyboardInterrupt):
        save(1)
    only_complete_checkpoints(tmp_path, [0])


# -- durability: synced before counted; a kill -9 mid-save loses nothing saved before it ----------------
def test_every_file_is_synced_before_the_manifest_counts_the_checkpoint(tmp_path, monkeypatch):
    """The order a power loss needs: every file and directory of the checkpoint ``fsync``ed, then
    ``meta.json`` written, synced and renamed into place, its directory synced; the older
    checkpoint pruned only after that."""
    events: list[tuple[str, str]] = []
    real_fsync, real_replace, real_rmtree = os.fsync, os.replace, shutil.rmtree

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    def rmtree(path, *a, **kw) -> None:
        events.append(("rmtree", str(path)))
        real_rmtree(path, *a, **kw)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(writer_mod.shutil, "rmtree", rmtree)
    save = Checkpointer(Trainer(), tmp_path, META, every=1, steps=4, keep=1, background=False)
    save(0)
    events.clear()
    save(1)
    ckpt = tmp_path / "checkpoints" / "step_000001"
    at = {e: i for i, e in enumerate(events)}  # the last time each event happened
    meta = at[("replace", str(ckpt / "meta.json"))]
    for f in ("state/a.bin", "state/b.bin"):
        assert at[("fsync", str(ckpt / f))] < meta, events
    for d in (ckpt / "state", ckpt):
        assert [i for i, e in enumerate(events) if e == ("fsync", str(d))][0] < meta, events
    assert at[("fsync", str(ckpt / "meta.json.tmp"))] < meta < at[("fsync", str(ckpt))], events
    assert meta < at[("fsync", str(ckpt.parent))] < at[("rmtree", str(ckpt.parent / "step_000000"))]
    assert json.loads((ckpt / "meta.json").read_text())["sync_s"] >= 0
    only_complete_checkpoints(tmp_path, [1])


@pytest.mark.parametrize("code", [errno.EINVAL, errno.EIO])
def test_a_sync_the_filesystem_cannot_do_is_skipped_and_a_failed_one_is_named(tmp_path, monkeypatch, code):
    """A filesystem that cannot ``fsync`` a directory (``EINVAL``, as some FUSE and network ones
    answer) still gets its checkpoint; one whose disk fails the sync of a file (``EIO``) fails the
    save in one line naming that file, the older checkpoint kept."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if (code == errno.EINVAL and path.is_dir()) or (code == errno.EIO and path.name == "b.bin"):
            raise OSError(code, os.strerror(code))
        real_fsync(fd)

    save = saver(Trainer(), tmp_path)
    save(0)
    monkeypatch.setattr(os, "fsync", fsync)
    if code == errno.EINVAL:
        assert save(1)["saved"]
        only_complete_checkpoints(tmp_path, [0, 1])
        return
    with pytest.raises(CheckpointWriteError) as e:
        save(1)
    b = tmp_path / "checkpoints" / "step_000001" / "state" / "b.bin"
    assert str(e.value) == f"checkpoint step_000001: writing {b}: {os.strerror(errno.EIO)}"
    only_complete_checkpoints(tmp_path, [0])


KILLED_CHILD = """
import os, sys, time
from pathlib import Path
from mllm_rl.checkpoint.writer import Checkpointer

run, where = Path(sys.argv[1]), sys.argv[2]

class Snapshot:
    nbytes = 2 * 65536
    def __init__(self, stall):
        self.stall = stall
    def write(self, path):
        (path / "state").mkdir()
        (path / "state" / "a.bin").write_bytes(os.urandom(65536))
        if self.stall and where == "writing":
            (run / "ready").touch()
            time.sleep(600)
        (path / "state" / "b.bin").write_bytes(os.urandom(65536))

class Trainer:
    step = 0
    def snapshot(self, path=None):
        return Snapshot(stall=self.step == 1)

if where == "manifest":  # the kill lands between meta.json.tmp and its rename
    real = os.replace
    def replace(src, dst):
        if str(dst).endswith("step_000001/meta.json"):
            (run / "ready").touch()
            time.sleep(600)
        real(src, dst)
    os.replace = replace

trainer = Trainer()
save = Checkpointer(trainer, run, {"backend": "jax", "lora_rank": 0}, every=1, steps=4, keep=2, background=True)
save(0)
save.flush()
trainer.step = 1
save(1)
save.flush()
"""


@pytest.mark.parametrize("where", ["writing", "manifest"])
def test_a_kill_9_during_a_background_save_loses_no_checkpoint_saved_before_it(tmp_path, where):
    """A process SIGKILLed while its background write of step 1 is in flight (in the trainer's
    files, or between ``meta.json.tmp`` and its rename): step 0, saved before, is still the newest
    checkpoint that verifies, and the unfinished step 1 is skipped by ``--resume``, never taken."""
    import signal
    import sys
    import time

    run = tmp_path / "run"
    run.mkdir()
    p = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, str(run), where], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (run / "ready").exists():
            assert p.poll() is None and time.monotonic() < deadline, "the child never reached the kill point"
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
    finally:
        p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    unfinished = run / "checkpoints" / "step_000001"
    assert (unfinished / "state" / "a.bin").is_file() and not (unfinished / "meta.json").exists()
    found, skipped = find_resumable(run, META)
    assert found is not None and found.step == 0 and found.verified
    assert [(d.name, "a save that did not finish" in why) for d, why in skipped] == [("step_000001", True)]


# -- python -m mllm_rl.checkpoint make into an existing directory ------------------------------------
def test_make_refuses_a_different_checkpoint_unless_forced_and_rewrites_the_same_one(tmp_path):
    cfg = get_preset("tiny")
    out = make_checkpoint(cfg, tmp_path / "ckpt", seed=1, show_progress=False)
    before = tree(out)
    for kwargs, differs in (({}, "mllm_rl_seed 1 there, 0 asked"),
                            ({"seed": 1, "dtype": "bfloat16"}, 'torch_dtype "float32" there, "bfloat16" asked')):  # fmt: skip
        with pytest.raises(ValueError) as e:
            make_checkpoint(cfg, out, show_progress=False, **kwargs)
        assert str(e.value) == (f"{out}: holds a different checkpoint (config.json: {differs}); "
                                "pass --force to replace it or choose another --out")  # fmt: skip
        assert tree(out) == before  # nothing written
    assert make_checkpoint(cfg, out, seed=1, show_progress=False) == out  # the same: idempotent
    assert tree(out) == before
    make_checkpoint(cfg, out, seed=2, shard_bytes=100_000, show_progress=False, force=True)
    assert json.loads((out / "config.json").read_text())["mllm_rl_seed"] == 2
    ref = make_checkpoint(cfg, tmp_path / "ref", seed=2, shard_bytes=100_000, show_progress=False)
    assert tree(out) == tree(ref)  # replaced: exactly what a fresh directory gets (old shard gone)


def test_make_refuses_a_checkpoint_it_did_not_write_and_a_file(tmp_path):
    other = tmp_path / "hub"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3", "torch_dtype": "bfloat16"}))
    with pytest.raises(ValueError, match=r"holds a different checkpoint \(config\.json: mllm_rl_preset unset there, \"tiny\" asked; torch_dtype \"bfloat16\" there, \"float32\" asked; mllm_rl_seed unset there, 0 asked, and \d+ more field\(s\)\); pass --force"):  # fmt: skip
        make_checkpoint(get_preset("tiny"), other, show_progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"file: exists and is not a directory; choose another --out$"):
        make_checkpoint(get_preset("tiny"), tmp_path / "file", show_progress=False)


def test_make_cli_force_replaces_and_without_it_exit_2_in_one_line(tmp_path):
    out = make_checkpoint(get_preset("tiny"), tmp_path / "ckpt", seed=1, show_progress=False)
    r = run_cli("mllm_rl.checkpoint", "make", "--preset", "tiny", "--out", str(out))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: {out}: holds a different checkpoint") and "--force" in r.stderr
    r = run_cli("mllm_rl.checkpoint", "make", "--preset", "tiny", "--out", str(out), "--force")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["mllm_rl_seed"] == 0


# -- dtypes ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,value", [("torch_dtype", "float8"), ("dtype", "float8_e4m3fn"),
                                       ("torch_dtype", "float64"), ("torch_dtype", "auto"), ("dtype", 16)])  # fmt: skip
def test_a_dtype_we_cannot_train_or_serve_is_refused_naming_the_field(key, value):
    cfg = get_preset("tiny").to_hf_config()
    with pytest.raises(ValueError) as e:
        parse_qwen3({**cfg, key: value})
    assert str(e.value) == (f"{key}: {value!r} is not a dtype we train and serve "
                            "(accepted: float32, bfloat16, float16)")  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_dtypes_we_train_and_serve_are_accepted(dtype):
    cfg = get_preset("tiny").to_hf_config()
    assert parse_qwen3({**cfg, "torch_dtype": dtype}).torch_dtype == dtype
    assert parse_qwen3({**cfg, "torch_dtype": None, "dtype": dtype}).torch_dtype == dtype


def test_a_float8_model_directory_is_refused_at_open(float8):
    with pytest.raises(CheckpointError) as e:
        ModelDir.open(float8)
    assert str(e.value).startswith(f"{float8}/config.json: torch_dtype: 'float8' is not a dtype")


# -- docs/ERRORS.md, the checkpoint rows as written ---------------------------------------------------
DOC_ROW = re.compile(r"^\| `(?P<cmd>python -m [^`]+)`(?P<rest>[^|]*)\| (?P<exit>\d) \| `(?P<msg>[^`]+)` \|$")


def doc_rows() -> list[tuple[str, int, str]]:
    text = (ROOT / "docs" / "ERRORS.md").read_text(encoding="utf-8")
    section = text.split("## Checkpoints: dtypes refused, directories not overwritten, writes that fail")[1]
    rows = [m for line in section.splitlines() if (m := DOC_ROW.match(line))]
    assert len(rows) >= 5
    assert any(m["exit"] == "1" and "CheckpointWriteError" in m["msg"] for m in rows)
    return [(m["cmd"], int(m["exit"]), m["msg"]) for m in rows if m["exit"] == "2" and not m["rest"].strip()]


@pytest.fixture
def float8(tiny_ckpt, tmp_path) -> Path:
    d = tmp_path / "float8"
    shutil.copytree(tiny_ckpt, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float8"}))
    return d


@pytest.mark.parametrize("cmd,code,message", doc_rows(), ids=lambda v: str(v)[:50])
def test_doc_row(cmd, code, message, tmp_path, float8):
    other = make_checkpoint(get_preset("tiny"), tmp_path / "other", seed=1, show_progress=False)
    notckpt = tmp_path / "notckpt"
    notckpt.mkdir()
    (notckpt / "notes.txt").write_text("mine")
    fmt = {"float8": str(float8), "other": str(other), "notckpt": str(notckpt)}
    before = {name: tree(Path(p)) for name, p in fmt.items()}
    argv = [t.format(**fmt) for t in shlex.split(cmd)]
    assert argv[:2] == ["python", "-m"]
    env = {"MLLM_RL_NO_PROGRESS": "1"}
    run_dir = tmp_path / "run"  # where a run that was not refused would write
    run = ["--wandb", "disabled", "--run-dir", str(run_dir)] if argv[2] == "mllm_rl.run" else []
    r = run_cli(argv[2], *argv[3:], *run, env=env)
    assert r.returncode == code, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.rstrip("\n") == message.format(**fmt)
    assert {name: tree(Path(p)) for name, p in fmt.items()} == before  # nothing written
    assert not run_dir.exists()


# -- a whole run whose checkpoint write hits RLIMIT_FSIZE ------------------------------------------
# (called by tests/jax/test_jax_checkpoint_faults.py and tests/torch/test_torch_checkpoint_faults.py
# with a real engine, and below on the fake backend)
FSIZE_LIMIT = 1 << 20  # the run's logs and report fit; the tiny model's trainer state does not


def check_refused_checkpoint_write(
    backend: str,
    model: Path,
    run_dir: Path,
    variants: list[list[str]],
    module: str = "mllm_rl.run",
    resume_after: bool = True,
) -> None:
    """A run (``python -m module``) saves step 0's checkpoint. Then, for each of ``variants``
    (extra flags), ``--resume --steps 3`` under ``RLIMIT_FSIZE`` (1 MiB, set in the child): step
    1's checkpoint write is refused (EFBIG), and the run exits 1, its stderr without a traceback,
    its last line the one ``error:`` line, as docs/ERRORS.md says; ``checkpoints/`` holds step 0's
    checkpoint exactly as it was, and nothing else (no unfinished checkpoint, no temporary
    directory). Finally, with ``resume_after``, ``--resume --steps 2`` restores step 0's checkpoint
    and finishes."""
    args = ["--backend", backend, "--model", str(model),
            "--run-dir", str(run_dir), "--checkpoint-every", "1", "--prompts-per-step", "4", "--group-size", "4",
            "--max-new-tokens", "6", "--max-running-requests", "16", "--console", "off", "--wandb", "disabled"]  # fmt: skip

    def run(*extra: str, limit: bool = False) -> subprocess.CompletedProcess:
        return run_cli(module, *args, *extra, env={"MLLM_RL_NO_PROGRESS": "1"}, timeout=600,
                       fsize=FSIZE_LIMIT if limit else None)  # fmt: skip

    r = run("--steps", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    ckpts = run_dir / "checkpoints"
    before = tree(ckpts)
    assert "step_000000/meta.json" in before
    (doc_msg,) = [m["msg"] for line in (ROOT / "docs" / "ERRORS.md").read_text().splitlines()
                  if (m := DOC_ROW.match(line)) and m["exit"] == "1" and "CheckpointWriteError" in m["msg"]]  # fmt: skip
    doc = re.compile(".*".join(re.escape(part) for part in doc_msg.split("...")))
    for extra in variants:
        r = run("--steps", "3", "--resume", *extra, limit=True)
        where = f"{backend} {' '.join(extra)}: {r.stderr[-3000:]}"
        assert r.returncode == 1, where
        assert "Traceback" not in r.stderr and "Event loop is closed" not in r.stderr, where
        lines = r.stderr.rstrip("\n").splitlines()
        assert [x for x in lines if x.startswith("error:")] == [lines[-1]], where
        last = lines[-1]  # run.py may add where it saved the traceback: " (traceback: .../traceback.txt)"
        assert last.startswith(
            f"error: CheckpointWriteError: checkpoint step_000001: writing {ckpts}/step_000001/"
        )
        assert ": File too large" in last and doc.match(last), where
        assert tree(ckpts) == before, where  # step 0's checkpoint as it was, nothing else left
        assert verify_rl_checkpoint(ckpts / "step_000000", {"backend": backend}).verified
    if not resume_after:
        return
    r = run("--steps", "2", "--resume")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = read_jsonl(run_dir / "phases.jsonl")
    inits = [x for x in recs if x["phase"] == "trainer_init"]
    assert inits[-1]["info"]["restored_from"].endswith("checkpoints/step_000000")
    assert [x["step"] for x in recs if x["phase"] == "train_step"][-1] == 1
    assert [d.name for d in rl_checkpoint_dirs(run_dir)] == ["step_000001", "step_000000"]
    assert find_resumable(run_dir, {"backend": backend})[0].step == 1


@pytest.mark.slow  # whole runs (on the fake backend)
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE and EFBIG as on Linux")
def test_a_checkpoint_write_past_the_file_size_limit_exits_1_and_the_older_checkpoint_resumes(
    tiny_ckpt, tmp_path
):
    """``check_refused_checkpoint_write`` whole (both variants: written in the phase and in the
    background, then the resume from the older checkpoint) on the fake backend, whose trainer writes
    its state through a temporary file as the backends' writers do: the one-line error, the removed
    unfinished checkpoint and the resume are the core's (``mllm_rl.checkpoint.writer``, the
    preflight's resume). Each backend's own writer under the limit: tests/jax, tests/torch."""
    pytest.importorskip("transformers", reason="a run renders its prompts with the model's tokenizer")
    check_refused_checkpoint_write(
        "fake", tiny_ckpt, tmp_path / "run", [[], ["--checkpoint-background"]], module="tests.fake_run"
    )

"""RL checkpoints on their cadence, written in the ``checkpoint`` phase or in the background.

A checkpoint counts once its files are synced and its ``meta.json`` manifest written, last; older
ones are pruned only then, so ``--resume`` always finds one. An ``OSError`` removes the unfinished
directory (one-line ``CheckpointWriteError``). ``background`` (docs/RL.md): the trainer's host
snapshot is written by one thread while the run goes on. Several processes share the directory:
process 0 makes it, all write, process 0 writes the manifest and prunes."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mllm_rl.checkpoint.resolve import CKPT_DIR, rl_checkpoint_dirs, sync_tree, write_meta
from mllm_rl.coordination import Coordinator, LocalCoordinator


def check_shared_dir(coord: Coordinator, run_dir: Path) -> None:
    """``RuntimeError`` on every process naming those that do not see a file process 0 wrote into
    ``run_dir`` (several processes checkpoint into one directory only if it is shared)."""
    if coord.count == 1:
        return
    probe = Path(run_dir) / ".shared-by-processes"
    if coord.index == 0:
        probe.write_text("written by process 0\n")
    coord.gather("checkpoint/shared-dir/written", "")
    seen = coord.gather("checkpoint/shared-dir/seen", "yes" if probe.exists() else "no")
    blind = [i for i, x in enumerate(seen) if x != "yes"]
    if blind:
        raise RuntimeError(
            f"checkpoints across {coord.count} processes need a run directory every process sees "
            f"(one host, or a filesystem all hosts mount): process(es) {blind} do not see {probe}; "
            f"put --run-dir there, or --checkpoint-every 0"
        )


class CheckpointWriteError(RuntimeError, OSError):
    """An RL checkpoint could not be written: a ``RuntimeError`` (exit 1) and an ``OSError`` whose
    ``str(e)`` is one line naming the checkpoint, the file and the reason."""

    def __init__(self, message: str, errno_: int | None = None, path: str | None = None) -> None:
        super().__init__(message)  # one argument: ``str(e)`` is the message, not "[Errno N] ..."
        self.errno, self.path = errno_, path


def write_error(ckpt: Path, e: OSError) -> CheckpointWriteError:
    """``e`` as ``checkpoint step_000003: writing <file or the directory>: <reason>``."""
    if isinstance(e, CheckpointWriteError):
        return e
    where = e.filename if e.filename is not None else ckpt
    reason = e.strerror or (os.strerror(e.errno) if e.errno else None) or str(e) or type(e).__name__
    if e.filename2 is not None:
        where = f"{where} -> {e.filename2}"
    line = f"checkpoint {ckpt.name}: writing {where}: {reason}".replace("\n", " ")
    return CheckpointWriteError(line, e.errno, str(where))


@dataclass
class _Write:
    step: int
    path: Path
    t0: float
    nbytes: int
    thread: threading.Thread | None = None
    seconds: float | None = None
    error: BaseException | None = None


class Checkpointer:
    """Saves ``trainer`` into ``run_dir/checkpoints/step_<k>`` every ``every`` steps and the last
    (``every`` 0: never), ``meta`` in each ``meta.json``; ``background``: via ``trainer.snapshot``."""

    def __init__(
        self,
        trainer: Any,
        run_dir: Path,
        meta: Mapping[str, Any],
        every: int,
        steps: int,
        keep: int,
        background: bool,
        coord: Coordinator | None = None,
    ) -> None:
        self.trainer, self.run_dir, self.meta = trainer, Path(run_dir), dict(meta)
        self.every, self.steps, self.keep, self.background = every, steps, keep, background
        self.coord: Coordinator = coord or LocalCoordinator()
        if self.coord.count > 1 and background:
            raise ValueError("--checkpoint-background: one process only (every process writes its shards)")
        self._pending: _Write | None = None

    def _told_failed(self, name: str) -> None:
        """This process failed at ``name``: tell the others (they raise there), keep its own error."""
        try:
            self._sync(name, failed=True)
        except RuntimeError:
            pass

    def _sync(self, name: str, failed: bool = False) -> None:
        """Every process at the same point of the same checkpoint; if one failed there, all raise."""
        if self.coord.count == 1:
            return
        said = self.coord.gather(f"checkpoint/{name}", "failed" if failed else "ok")
        if "failed" in said:
            bad = [i for i, x in enumerate(said) if x == "failed"]
            raise RuntimeError(f"checkpoint {name}: process(es) {bad} failed")

    def due(self, step: int) -> bool:
        """Is a checkpoint saved at ``step`` (every ``every`` steps, and the last step)?"""
        return self.every > 0 and ((step + 1) % self.every == 0 or step == self.steps - 1)

    def __call__(self, step: int) -> dict[str, Any]:
        """The ``checkpoint`` phase's work; its info (``saved``: complete now; ``written``: ended
        background writes)."""
        due = self.due(step)
        info: dict[str, Any] = {}
        written = self._collect(wait=due)
        if written:
            info["written"] = written
        if not due:
            return {"saved": False, "path": None, **info}
        path = self.run_dir / CKPT_DIR / f"step_{step:06d}"
        leader = self.coord.index == 0
        try:
            if leader:
                if path.exists():
                    shutil.rmtree(path)
                path.mkdir(parents=True)
        except OSError as e:
            self._told_failed(f"{path.name}/dir")
            raise write_error(path, e) from None
        self._sync(f"{path.name}/dir")
        try:
            snap = self.trainer.snapshot(path) if self.background else None
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        if snap is None:
            self._written(step, path, self.trainer.save)
            return {"saved": True, "path": str(path), **info}
        w = _Write(step, path, time.perf_counter(), int(snap.nbytes))
        w.thread = threading.Thread(
            target=self._write, args=(w, snap), name=f"checkpoint-{step}", daemon=True
        )
        w.thread.start()
        self._pending = w
        return {"saved": False, "path": str(path), "background": True, "snapshot_bytes": w.nbytes, **info}

    def flush(self) -> list[dict[str, Any]]:
        """Wait for a background write still running; what ended (raises the write's error)."""
        return self._collect(wait=True)

    def abandon(self) -> None:
        """After a failure elsewhere: let a running write finish (resumable), not raising its error."""
        w, self._pending = self._pending, None
        if w is not None and w.thread is not None:
            w.thread.join()

    def _collect(self, wait: bool) -> list[dict[str, Any]]:
        w = self._pending
        if w is None or w.thread is None or (w.thread.is_alive() and not wait):
            return []
        w.thread.join()
        self._pending = None
        if w.error is not None:
            raise w.error
        return [
            {"step": w.step, "path": str(w.path), "seconds": round(w.seconds or 0.0, 4), "bytes": w.nbytes}
        ]

    def _write(self, w: _Write, snap: Any) -> None:
        try:
            self._written(w.step, w.path, snap.write)
        except BaseException as e:  # raised on the main thread where the write is collected
            w.error = e
        finally:
            w.seconds = time.perf_counter() - w.t0

    def _written(self, step: int, path: Path, write: Any) -> None:
        """``write(path)``, then the manifest; a failure removes ``path`` (``OSError``: as a
        ``CheckpointWriteError``)."""
        leader = self.coord.index == 0
        try:
            try:
                known = write(path)  # what it hashed while writing, if anything
                sync_s = sync_tree(path)  # on disk before the manifest may count it
            except BaseException:
                self._told_failed(f"{path.name}/written")
                raise
            self._sync(f"{path.name}/written")
            if leader:  # the checkpoint counts from here on (meta.json with the manifest, written last)
                try:
                    write_meta(path, {"step": step, **self.meta, "sync_s": round(sync_s, 4)}, known)
                except BaseException:
                    self._told_failed(f"{path.name}/meta")
                    raise
        except BaseException as e:
            if leader:
                shutil.rmtree(path, ignore_errors=True)
            if isinstance(e, OSError):
                raise write_error(path, e) from None
            raise
        self._sync(f"{path.name}/meta")
        if not leader:
            return
        try:  # the oldest pruned only once this one is complete; best effort
            for old in rl_checkpoint_dirs(self.run_dir)[self.keep :]:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass

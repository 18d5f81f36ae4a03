"""A checkpoint written by several processes (each its shards, as orbax does in a multi-process JAX
run): process 0 makes the directory and writes the manifest once every process has written, a
process that fails makes every process fail, and a run directory the processes do not share is
refused. The processes are threads here, joined by a coordinator with the ``gather`` contract of
``mllm_rl.coordination`` (the real one, over jax.distributed, runs in tests/jax/test_launch_run.py)."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from mllm_rl.checkpoint.resolve import verify_rl_checkpoint
from mllm_rl.checkpoint.writer import Checkpointer, CheckpointWriteError, check_shared_dir


class Hub:
    """What the processes share: one value per (name, process), a barrier per name."""

    def __init__(self, count: int) -> None:
        self.count, self.values, self.cond = count, {}, threading.Condition()

    def gather(self, index: int, name: str, value: str) -> list[str]:
        with self.cond:
            self.values[(name, index)] = value
            self.cond.notify_all()
            ok = self.cond.wait_for(lambda: all((name, i) in self.values for i in range(self.count)), 20)
            assert ok, f"gather {name!r}: not every process came"
            return [self.values[(name, i)] for i in range(self.count)]


class ThreadCoordinator:
    def __init__(self, hub: Hub, index: int) -> None:
        self.hub, self.index, self.count = hub, index, hub.count

    def gather(self, name: str, value: str) -> list[str]:
        return self.hub.gather(self.index, name, value)


class ShardTrainer:
    """Writes its own shard file; the checkpoint's directory must exist already (process 0's)."""

    def __init__(self, index: int, fail_at: int | None = None) -> None:
        self.index, self.fail_at = index, fail_at

    def save(self, path: Path) -> None:
        assert path.is_dir(), "written before process 0 made the directory"
        if int(path.name.removeprefix("step_")) == self.fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path / f"shard.{self.index}"))
        (path / f"shard.{self.index}").write_bytes(os.urandom(4096))

    def snapshot(self, path: Path | None = None) -> None:
        return None


def run_processes(n: int, work) -> list[Any]:
    hub, out = Hub(n), [None] * n

    def one(i: int) -> None:
        try:
            out[i] = work(ThreadCoordinator(hub, i))
        except BaseException as e:  # noqa: BLE001 -- the test looks at each process's ending
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_every_process_writes_its_shard_and_process_0_the_manifest(tmp_path):
    def work(coord):
        save = Checkpointer(ShardTrainer(coord.index), tmp_path, {"backend": "jax"}, 1, 3, 2, False, coord)
        return [save(step)["saved"] for step in range(3)]

    assert run_processes(2, work) == [[True] * 3, [True] * 3]
    ckpts = sorted((tmp_path / "checkpoints").iterdir())
    assert [c.name for c in ckpts] == ["step_000001", "step_000002"]  # process 0 pruned step 0
    for c in ckpts:
        verify_rl_checkpoint(c)  # the manifest names both shards, with their sha256
        assert {"shard.0", "shard.1"} <= set(__import__("json").loads((c / "meta.json").read_text())["files"])


def test_a_process_that_fails_to_write_fails_every_process(tmp_path):
    def work(coord):
        save = Checkpointer(ShardTrainer(coord.index, fail_at=1 if coord.index == 1 else None), tmp_path,
                            {"backend": "jax"}, 1, 3, 2, False, coord)  # fmt: skip
        save(0)
        save(1)

    p0, p1 = run_processes(2, work)
    assert isinstance(p1, CheckpointWriteError) and "No space left on device" in str(p1)
    assert isinstance(p0, RuntimeError) and "process(es) [1] failed" in str(p0)
    assert sorted(c.name for c in (tmp_path / "checkpoints").iterdir()) == ["step_000000"]  # removed


def test_a_run_directory_one_process_does_not_see_is_refused(tmp_path):
    dirs = [tmp_path / "host0", tmp_path / "host1"]  # as two hosts' local disks
    for d in dirs:
        d.mkdir()
    out = run_processes(2, lambda coord: check_shared_dir(coord, dirs[coord.index]))
    for e in out:
        assert isinstance(e, RuntimeError) and "process(es) [1] do not see" in str(e), e
    assert run_processes(2, lambda coord: check_shared_dir(coord, dirs[0])) == [None, None]


def test_background_writes_are_one_process_only(tmp_path):
    with pytest.raises(ValueError, match="--checkpoint-background: one process only"):
        Checkpointer(ShardTrainer(0), tmp_path, {}, 1, 3, 2, True, ThreadCoordinator(Hub(2), 0))

"""A torch run whose checkpoint write the OS refuses (``RLIMIT_FSIZE``), written in the phase or in
the background (``--checkpoint-background``): exit 1 in one line naming the file and the reason
(torch's writer says only ``unexpected pos ...``), no ``.state.pt.tmp`` left, the older checkpoint
resumes."""

from __future__ import annotations

import errno
import hashlib
import resource
import sys
import zipfile

import pytest
import torch

from mllm_rl.backends.torch.state_file import STATE_FILE, load_state, split, write_state
from tests.core.test_checkpoint_faults import check_refused_checkpoint_write


def test_a_refused_state_write_names_the_file_and_leaves_no_temporary_file(tmp_path):
    state = {"trainable": {"w": torch.randn(1 << 19)}, "step": 3}  # 2 MiB
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(OSError) as e:
            write_state(state, tmp_path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert e.value.errno == errno.EFBIG and e.value.filename == str(tmp_path / f".{STATE_FILE}.tmp")
    assert list(tmp_path.iterdir()) == []
    write_state(state, tmp_path)  # without the limit: written, and loads back
    assert torch.equal(
        torch.load(tmp_path / STATE_FILE, weights_only=True)["trainable"]["w"], state["trainable"]["w"]
    )
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]


def _big_state():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1 << 19, generator=g)  # 2 MiB, two views of it
    return {
        "trainable": {f"w{i}": torch.randn((i + 1) << 17, generator=g) for i in range(5)},
        "optimizer": {"state": {0: {"step": torch.tensor(3.0), "a": base[:100], "b": base[100:]}},
                      "param_groups": [{"betas": (0.9, 0.95), "params": [0]}]},
        "step": 3,
    }  # fmt: skip


def test_a_state_written_as_several_files_loads_back_equal_and_each_file_is_hashed(tmp_path):
    """``write_state`` with 3 shards: ``state.pt`` (the structure) and ``state.1.pt``,
    ``state.2.pt``, each hashed while written (the manifest equals a read-back), the bytes spread
    over the files, views of one storage kept in one file; ``load_state`` gives the state back."""
    state = _big_state()
    entry = write_state(state, tmp_path, shards=3)
    names = ["state.1.pt", "state.2.pt", STATE_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == names
    for name in names:
        data = (tmp_path / name).read_bytes()
        assert entry[name] == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    sizes = sorted(e["bytes"] for e in entry.values())
    assert sizes[0] > sizes[-1] / 2  # 4.5 MiB of tensors spread over the three
    back = load_state(tmp_path)
    for n, t in state["trainable"].items():
        assert torch.equal(back["trainable"][n], t), n
    st = back["optimizer"]["state"][0]
    assert torch.equal(st["a"], state["optimizer"]["state"][0]["a"]) and torch.equal(
        st["step"], torch.tensor(3.0)
    )
    assert (
        st["a"].untyped_storage().data_ptr() == st["b"].untyped_storage().data_ptr()
    )  # one storage, one file
    assert back["optimizer"]["param_groups"] == state["optimizer"]["param_groups"] and back["step"] == 3
    one = split(state, 1)
    assert (
        len(one) == 1 and one[0]["trainable"]["w0"] is state["trainable"]["w0"]
    )  # one shard: the state as is


@pytest.mark.parametrize("drop_every", [64 << 10, None])
def test_written_pages_are_synced_and_dropped_every_drop_every_bytes(tmp_path, monkeypatch, drop_every):
    """Once ``drop_every`` bytes were written since the last time (torch writes a tensor in one
    call), a file's pages are synced (``fdatasync``) and dropped from the page cache
    (``POSIX_FADV_DONTNEED``), and the state still loads back equal with its hashes; None:
    neither. A sync the OS refuses fails the write like a refused write: its ``OSError`` names the
    temporary file, and no file is left."""
    import os

    calls = {"sync": 0, "drop": 0}
    sync, advise = os.fdatasync, os.posix_fadvise

    def counted_sync(fd):
        calls["sync"] += 1
        return sync(fd)

    def counted_advise(fd, offset, length, advice):
        calls["drop"] += advice == os.POSIX_FADV_DONTNEED
        return advise(fd, offset, length, advice)

    monkeypatch.setattr(os, "fdatasync", counted_sync)
    monkeypatch.setattr(os, "posix_fadvise", counted_advise)
    state = _big_state()
    entry = write_state(state, tmp_path, shards=3, drop_every=drop_every)
    total = sum(e["bytes"] for e in entry.values())
    if drop_every is None:
        assert calls == {"sync": 0, "drop": 0}
    else:  # each of the 3 files (1.5 MiB or more) at least once; at most once per drop_every bytes
        assert 3 <= calls["sync"] == calls["drop"] <= total // drop_every, (calls, total)
    for name, e in entry.items():
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == e["sha256"], name
    assert torch.equal(load_state(tmp_path)["trainable"]["w4"], state["trainable"]["w4"])
    if drop_every is None:
        return

    def refused(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", refused)
    again = tmp_path / "again"
    again.mkdir()
    with pytest.raises(OSError) as e:
        write_state(state, again, shards=3, drop_every=drop_every)
    assert e.value.errno == errno.EIO and e.value.filename.endswith(".pt.tmp"), e.value
    assert list(again.iterdir()) == []


def test_a_failed_write_of_one_shard_leaves_no_file_and_a_missing_shard_is_named(tmp_path):
    """The OS refuses one shard's write (``RLIMIT_FSIZE`` below the largest file): the ``OSError``
    names a temporary file and no file of the state is left (none is renamed before all are written). A
    checkpoint missing a shard file does not load: the error names it."""
    state = _big_state()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(1.8 * (1 << 20)), hard))
    try:
        with pytest.raises(OSError) as e:
            write_state(state, tmp_path, shards=3)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert e.value.errno == errno.EFBIG and e.value.filename.endswith(".pt.tmp"), e.value
    assert list(tmp_path.iterdir()) == []
    write_state(state, tmp_path, shards=3)
    (tmp_path / "state.2.pt").unlink()
    with pytest.raises(ValueError, match=r"state\.2\.pt: missing \(state\.pt refers to it\)"):
        load_state(tmp_path)


@pytest.mark.slow  # two runs of the tiny model
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE and EFBIG as on Linux")
def test_a_checkpoint_write_past_the_file_size_limit_exits_1_and_keeps_the_older_checkpoint(
    tiny_ckpt, tmp_path
):
    """torch's state write of a real run refused by ``RLIMIT_FSIZE`` (in the background, on the
    writer's thread): one ``error:`` line naming the file, no ``.state.pt.tmp`` left, step 0's
    checkpoint exactly as it was. The write in the phase, and the resume that follows, are checked
    on the fake backend (tests/core/test_checkpoint_faults.py): they are the core's, and the same
    ``write_state`` writes in both."""
    check_refused_checkpoint_write(
        "torch", tiny_ckpt, tmp_path / "run", [["--checkpoint-background"]], resume_after=False
    )


def test_the_state_is_written_without_torchs_crc32_and_the_option_is_restored(tmp_path):
    """The zip records carry no CRC32 (the manifest's sha256 is the checksum, checked before a
    resume), the file loads back equal, and torch's global option is as it was, after a write that
    failed too."""
    from torch.serialization import get_crc32_options

    state = {"trainable": {"w": torch.randn(1 << 16)}, "step": 3}
    entry = write_state(state, tmp_path)
    with zipfile.ZipFile(tmp_path / STATE_FILE) as z:
        assert {i.CRC for i in z.infolist()} == {0}
    assert torch.equal(
        torch.load(tmp_path / STATE_FILE, weights_only=True)["trainable"]["w"], state["trainable"]["w"]
    )
    assert entry[STATE_FILE]["bytes"] == (tmp_path / STATE_FILE).stat().st_size
    assert get_crc32_options() is True
    with pytest.raises(OSError):
        write_state(state, tmp_path / "missing")  # no such directory
    assert get_crc32_options() is True

"""A JAX run whose orbax checkpoint write the OS refuses (``RLIMIT_FSIZE``), in the phase or in the
background (orbax's asynchronous save, ``--checkpoint-background``): exit 1 in one line, no
traceback (orbax logs the error with tracebacks from three threads, tensorstore's abandoned writes
print ``Event loop is closed`` ones), no temporary directory, the older checkpoint resumes
(``backends/jax/orbax_io.py``)."""

from __future__ import annotations

import errno
import logging
import sys
from pathlib import Path

import pytest

from mllm_rl.backends.jax.orbax_io import closed_loop_callback, os_error_of
from tests.core.test_checkpoint_faults import check_refused_checkpoint_write

ORBAX_EFBIG = (
    'OUT_OF_RANGE: Error writing "opt_state.1.0.mu.embed_tokens.value/0.0" in OCDBT database at local file '
    '"/r/checkpoints/step_000000/state.orbax-checkpoint-tmp/ocdbt.process_0/": Failed writing: '
    '"/r/checkpoints/step_000000/state.orbax-checkpoint-tmp/ocdbt.process_0/d/b445": Failed to write 2949120 '
    "bytes to file 66: File too large [os_error_code='27']"
)  # orbax 0.12.8 / tensorstore 0.1.86, verbatim but for the paths


def test_orbax_errors_that_report_an_os_error_become_that_os_error():
    e = os_error_of(ValueError(ORBAX_EFBIG), Path("/r/state"))
    assert isinstance(e, OSError) and e.errno == errno.EFBIG and e.strerror == "File too large"
    assert e.filename == "/r/checkpoints/step_000000/state.orbax-checkpoint-tmp/ocdbt.process_0/d/b445"
    try:
        raise RuntimeError("commit failed") from ValueError("NOT_FOUND: ... [os_error_code=28]")
    except RuntimeError as wrapped:
        e = os_error_of(wrapped, Path("/r/state"))
    assert (e.errno, e.filename) == (errno.ENOSPC, "/r/state")  # no path quoted: the target
    assert os_error_of(ValueError("INVALID_ARGUMENT: bad spec"), Path("/r/state")) is None
    perm = PermissionError(errno.EACCES, "Permission denied", "/r/state")
    assert os_error_of(perm, Path("/r/state")) is perm


def test_only_callbacks_into_a_closed_event_loop_are_dropped():
    import asyncio

    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(print)
    except RuntimeError as e:
        closed = e
    assert closed_loop_callback(closed, closed.__traceback__)
    assert not closed_loop_callback(RuntimeError("Event loop is closed"), None)  # raised elsewhere
    try:
        raise RuntimeError("something else")
    except RuntimeError as e:
        assert not closed_loop_callback(e, e.__traceback__)


def test_only_unread_errors_of_a_failed_save_are_dropped_from_the_asyncio_log(caplog):
    """A future left on orbax's closed loop holds the failed save's error; asyncio logs it, with a
    traceback, when the future is collected. Those records of a reported target are dropped (at
    once or later); an unread error of anything else is still logged."""
    import asyncio
    import gc

    from mllm_rl.backends.jax.orbax_io import _drop_unread_errors_of

    def unread(message: str) -> None:
        loop = asyncio.new_event_loop()
        fut = loop.create_future()
        fut.set_exception(ValueError(message))
        loop.close()
        del fut, loop
        gc.collect()

    caplog.set_level(logging.ERROR, logger="asyncio")
    unread(ORBAX_EFBIG)  # before any save failed: logged
    assert [r for r in caplog.records if "never retrieved" in r.getMessage()]
    caplog.clear()
    _drop_unread_errors_of(Path("/r/checkpoints/step_000000/state"))
    unread(ORBAX_EFBIG)
    unread(ORBAX_EFBIG.replace("step_000000", "step_000007"))  # another target: logged
    logged = [str(r.exc_info[1]) for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len(logged) == 1 and "step_000007" in logged[0]


def test_a_save_that_cannot_begin_closes_its_checkpointer(tmp_path, monkeypatch):
    """orbax refuses to begin a save onto an existing directory; the checkpointer (its threads)
    is closed before the error propagates, once."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from mllm_rl.backends.jax.orbax_io import AsyncSave

    closed: list[object] = []
    close = ocp.AsyncCheckpointer.close
    monkeypatch.setattr(ocp.AsyncCheckpointer, "close", lambda s: (closed.append(s), close(s)))
    (tmp_path / "state").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        AsyncSave(tmp_path / "state", {"a": jnp.ones(3)})
    assert len(closed) == 1
    AsyncSave(tmp_path / "other", {"a": jnp.ones(3)}).write()
    assert len(closed) == 2 and (tmp_path / "other").is_dir()


def orbax_compressors(state: Path) -> set[str | None]:
    """The compressor of every array of orbax checkpoint ``state`` (its OCDBT store), read from
    each array's zarr metadata (zarr3 ``zarr.json`` or zarr2 ``.zarray``): ``zstd`` or None."""
    import json

    import tensorstore as ts

    base = f"file://{state.resolve()}/"
    kv = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
    found = set()
    for key in kv.list().result():
        if key.endswith((b"/zarr.json", b"/.zarray")):
            meta = json.dumps(json.loads(kv.read(key).result().value))
            found.add("zstd" if "zstd" in meta else None)
    return found


def test_a_save_is_uncompressed_unless_asked_and_either_restores(tmp_path):
    """``AsyncSave`` writes raw arrays by default, orbax's zstd when asked; a restore reads both
    (through ``StandardCheckpointer``, as the trainer restores), value for value, and the zarr2
    files ``StandardCheckpointer`` itself writes (checkpoints of earlier versions)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    from mllm_rl.backends.jax.orbax_io import AsyncSave

    tree = {"zeros": jnp.zeros((512, 512)), "m": {"v": jnp.arange(4096, dtype=jnp.bfloat16)}}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
    sizes = {}
    for compress in (False, True):
        target = tmp_path / str(compress) / "state"
        AsyncSave(target, tree, compress=compress).write()
        assert orbax_compressors(target) == ({"zstd"} if compress else {None})
        sizes[compress] = sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
        back = ocp.StandardCheckpointer().restore(target.resolve(), abstract)
        for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
    assert sizes[False] > 512 * 512 * 4 > 100 * sizes[True]  # a MiB of zeros: raw, then a few KiB
    old = tmp_path / "zarr2" / "state"
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(old, tree)
    back = ocp.StandardCheckpointer().restore(old.resolve(), abstract)
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(back), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_a_large_state_is_written_in_data_files_of_bounded_size(tmp_path, monkeypatch):
    """The arrays go into OCDBT data files of about ``DATA_FILE_BYTES`` (orbax's own default is
    2 GiB), which the manifest then hashes in parallel, one file per thread."""
    import jax

    from mllm_rl.backends.jax import orbax_io

    monkeypatch.setattr(orbax_io, "DATA_FILE_BYTES", 1 << 20)
    keys = jax.random.split(jax.random.key(0), 8)
    tree = {f"t{i}": jax.random.normal(k, (2**18,)) for i, k in enumerate(keys)}  # 8 MiB
    orbax_io.AsyncSave(tmp_path / "state", tree).write()
    data = [f.stat().st_size for f in (tmp_path / "state").rglob("d/*") if f.is_file()]
    assert len(data) >= 6 and sum(data) >= 8 << 20 and max(data) <= 2 << 20, sorted(data)


@pytest.mark.slow  # two runs of the tiny model
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE and EFBIG as on Linux")
def test_a_checkpoint_write_past_the_file_size_limit_exits_1_and_keeps_the_older_checkpoint(
    tiny_ckpt, tmp_path
):
    """The orbax write of a real run refused by ``RLIMIT_FSIZE`` (the trainer's asynchronous save
    ending on the writer's thread): one ``error:`` line, no orbax or tensorstore traceback, step 0's
    checkpoint exactly as it was. The write in the phase, and the resume that follows, are checked
    on the fake backend (tests/core/test_checkpoint_faults.py): they are the core's, and the same
    orbax save (``AsyncSave``) writes in both."""
    check_refused_checkpoint_write(
        "jax", tiny_ckpt, tmp_path / "run", [["--checkpoint-background"]], resume_after=False
    )


def test_bench_checkpoint_write_times_orbax_raw_and_zstd_against_the_host_copy(tmp_path):
    """``python -m mllm_rl.bench checkpoint-write --framework jax``: the JAX trainer's save (raw,
    synced, its manifest read back) and the zstd one beside a host copy, its files removed."""
    import json
    import subprocess

    from tests.conftest import ROOT

    out = tmp_path / "out.json"
    r = subprocess.run([sys.executable, "-m", "mllm_rl.bench", "checkpoint-write", "--framework", "jax",
                        "--mb", "8", "--repeats", "1", "--dir", str(tmp_path), "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last == json.loads(out.read_text()) and last["framework"] == "jax" and last["figure"] == "CPU"
    ways = {
        "host copy",
        "the trainer's: orbax, raw, synced + manifest",
        "orbax, zstd (--checkpoint-compression)",
    }
    assert set(last["median_s"]) == ways and all(v > 0 for v in last["median_s"].values())
    assert last["x_host_copy"]["host copy"] == 1.0 and last["bytes"] == 8 * 2**20
    assert "CPU figure" in r.stdout and list(tmp_path.iterdir()) == [out]  # its files are gone
    bad = subprocess.run([sys.executable, "-m", "mllm_rl.bench", "checkpoint-write", "--framework", "jax",
                          "--shards", "2"], capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--shards: the torch trainer's file count" in bad.stderr

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
    close = ocp.StandardCheckpointer.close
    monkeypatch.setattr(ocp.StandardCheckpointer, "close", lambda s: (closed.append(s), close(s)))
    (tmp_path / "state").mkdir()
    with pytest.raises(ValueError, match="already exists"):
        AsyncSave(tmp_path / "state", {"a": jnp.ones(3)})
    assert len(closed) == 1
    AsyncSave(tmp_path / "other", {"a": jnp.ones(3)}).write()
    assert len(closed) == 2 and (tmp_path / "other").is_dir()


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

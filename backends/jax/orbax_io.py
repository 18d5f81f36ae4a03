"""The JAX trainer's orbax write, with a failed write said once, as an ``OSError``.

When a write fails (a full disk, ``RLIMIT_FSIZE``, a lost permission), orbax 0.12 and tensorstore
0.1 do four things ``AsyncSave`` undoes: the error is a ``ValueError`` (it becomes the ``OSError``
it reports); orbax logs a traceback from each thread (held, dropped on failure); the first failure
closes orbax's event loop while other writes go on and call back into it (the save waits for every
tensorstore future, and an unraisable hook drops those callbacks); the futures left waiting on
the closed loop hold that error unread, and asyncio logs it with a traceback when they are
collected (collected at once, and only the errors of the failed save dropped).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SETTLE_S = 30.0  # longest wait for the writes a failed save abandoned
# OCDBT data files of at most this size (orbax's default: 2 GiB): the manifest hashes one file per
# thread, so a state in many files is hashed on as many cores (MaxText's settings: zarr3 + OCDBT)
DATA_FILE_BYTES = 256 << 20
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)'?")
_QUOTED_PATH = re.compile(r'"(/[^"]+)"')


class AsyncSave:
    """orbax's asynchronous save of ``tree`` into ``target``, begun on construction (it returns
    once the arrays are in host memory); ``write`` waits for the files. A write the OS refused
    is raised as ``OSError(errno, reason, file)`` once every write begun has ended.

    ``compress``: orbax's zstd on every array (its default). Off, the save is a copy to disk: zstd
    costs more CPU than the write itself, and a trained float32 state barely compresses. Arrays
    are zarr3 in OCDBT data files of ``DATA_FILE_BYTES``; ``StandardCheckpointer`` restores them
    (and the zarr2 files of earlier saves) from their metadata."""

    def __init__(self, target: Path, tree: Any, compress: bool = False) -> None:
        import jax
        import orbax.checkpoint as ocp

        self.target = target
        self.nbytes = sum(int(x.nbytes) for x in jax.tree.leaves(tree))
        handler = ocp.PyTreeCheckpointHandler(use_compression=compress, use_zarr3=True)
        self._ckpt = ocp.AsyncCheckpointer(handler)
        args = ocp.args.PyTreeSave(tree, ocdbt_target_data_file_size=DATA_FILE_BYTES)
        try:
            self._run(lambda: self._ckpt.save(target, args=args))
        except BaseException:
            self._ckpt.close()  # its threads end with the save that never began
            raise

    def write(self, path: Path | None = None) -> None:
        """Wait until every file is written (``path``: the checkpoint's, for the writer's call)."""
        try:
            self._run(self._ckpt.wait_until_finished)
        finally:
            self._ckpt.close()

    def _run(self, fn: Any) -> None:
        with _held_orbax_logs():
            try:
                fn()
            except BaseException as e:
                settle_tensorstore()
                os_error = os_error_of(e, self.target)
                if os_error is None:
                    raise
                _drop_unread_errors_of(self.target)
                raise os_error from None


def os_error_of(e: BaseException, target: Path) -> OSError | None:
    """The ``OSError`` a tensorstore/orbax error reports (its code and path), or None."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError):
            return cur
        text = str(cur)
        m = _OS_ERROR_CODE.search(text)
        if m:
            code = int(m.group(1))
            paths = _QUOTED_PATH.findall(text[: m.start()])
            return OSError(code, os.strerror(code), paths[-1] if paths else str(target))
        cur = cur.__cause__ or cur.__context__
    return None


def settle_tensorstore(timeout_s: float = SETTLE_S) -> int:
    """Wait (at most ``timeout_s``) for every tensorstore future not yet done; returns how many."""
    import tensorstore as ts

    pending = [o for o in gc.get_objects() if isinstance(o, (ts.Future, ts.WriteFutures)) and not o.done()]
    end = time.monotonic() + timeout_s
    for f in pending:
        left = end - time.monotonic()
        if left <= 0:
            break
        try:
            (f.commit if isinstance(f, ts.WriteFutures) else f).result(timeout=left)
        except Exception:  # noqa: BLE001 - its own failure, or the timeout: it has ended or we stop
            pass
    return len(pending)


class _DropUnread(logging.Filter):
    """Drops asyncio's "exception was never retrieved" records whose error names a failed target."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or "exception was never retrieved" not in str(record.msg):
            return True
        return not any(t in str(exc) for t in self.targets)


_UNREAD = _DropUnread()


def _drop_unread_errors_of(target: Path) -> None:
    """From now on, asyncio's report of an unread error naming ``target`` (a save that failed and
    was reported) is dropped; the futures a failed save left are collected now."""
    _UNREAD.targets.add(str(target))
    logger = logging.getLogger("asyncio")
    if _UNREAD not in logger.filters:
        logger.addFilter(_UNREAD)
    gc.collect()


class _Hold(logging.Filter):
    """Holds the records orbax logs (to ``absl``) instead of letting them through."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if f"{os.sep}orbax{os.sep}" in record.pathname:
            self.records.append(record)
            return False
        return True


@contextlib.contextmanager
def _held_orbax_logs() -> Iterator[None]:
    """Orbax's log records held for the block (replayed on success); closed-loop callbacks dropped."""
    absl = logging.getLogger("absl")
    hold = _Hold()
    absl.addFilter(hold)
    before = sys.unraisablehook
    if not getattr(before, "drops_closed_loop_callbacks", False):
        sys.unraisablehook = _dropping_closed_loop_callbacks(before)
    try:
        yield
    except BaseException:
        absl.removeFilter(hold)
        raise
    absl.removeFilter(hold)
    sys.unraisablehook = before
    for record in hold.records:
        absl.handle(record)


def _dropping_closed_loop_callbacks(hook: Any) -> Any:
    def drop(unraisable: Any) -> None:
        if not closed_loop_callback(unraisable.exc_value, unraisable.exc_traceback):
            hook(unraisable)

    drop.drops_closed_loop_callbacks = True  # type: ignore[attr-defined]
    return drop


def closed_loop_callback(exc: BaseException | None, tb: Any) -> bool:
    """Is ``exc`` a ``RuntimeError('Event loop is closed')`` raised in ``call_soon_threadsafe``?"""
    if not isinstance(exc, RuntimeError) or str(exc) != "Event loop is closed":
        return False
    while tb is not None:
        if tb.tb_frame.f_code.co_name.endswith("call_soon_threadsafe"):
            return True
        tb = tb.tb_next
    return False

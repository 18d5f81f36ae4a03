"""Progress bars for long work that stay quiet under CI and when output is not a TTY."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO


def progress_enabled() -> bool:
    """True when stderr is a terminal and neither ``CI`` nor ``MLLM_RL_NO_PROGRESS`` is set."""
    if os.environ.get("CI") or os.environ.get("MLLM_RL_NO_PROGRESS"):
        return False
    return sys.stderr.isatty()


def write(line: str, stream: TextIO) -> None:
    """``line`` on ``stream``, above any progress bar on the terminal (``tqdm.write`` clears and
    redraws the bars; a plain write when progress is off)."""
    if progress_enabled():
        from tqdm import tqdm

        tqdm.write(line, file=stream)
    else:
        stream.write(line + "\n")
    stream.flush()


class _Null:
    def update(self, n: int = 1) -> None: ...
    def set_postfix_str(self, s: str) -> None: ...


@contextmanager
def progress_bar(total: int | None, desc: str, unit: str = "it", enabled: bool = True) -> Iterator[Any]:
    """A tqdm bar (bytes scaled when ``unit='B'``), or a no-op object when disabled."""
    if not (enabled and progress_enabled()):
        yield _Null()
        return
    from tqdm import tqdm

    with tqdm(
        total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024, leave=False
    ) as bar:
        yield bar


@contextmanager
def waiting(desc: str, enabled: bool = True, every_s: float = 0.5) -> Iterator[None]:
    """A line with the time spent so far on work that has no count (an engine start, a trainer's
    build and first compile, a dataset read), refreshed every ``every_s`` by a thread and cleared
    when done; nothing when progress is off (``progress_enabled``)."""
    if not (enabled and progress_enabled()):
        yield
        return
    import threading

    from tqdm import tqdm

    done = threading.Event()
    with tqdm(total=None, desc=desc, bar_format="{desc}: {elapsed}", leave=False) as bar:

        def tick() -> None:
            while not done.wait(every_s):
                bar.refresh()

        t = threading.Thread(target=tick, name=f"waiting:{desc}", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()

"""Progress bars for long work that stay quiet under CI and when output is not a TTY."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def progress_enabled() -> bool:
    """True when stderr is a terminal and neither ``CI`` nor ``MLLM_RL_NO_PROGRESS`` is set."""
    if os.environ.get("CI") or os.environ.get("MLLM_RL_NO_PROGRESS"):
        return False
    return sys.stderr.isatty()


class _Null:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass


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

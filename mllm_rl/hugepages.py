"""Transparent huge pages for a run's host memory (Linux, glibc >= 2.35, THP mode ``madvise``).

A run's large buffers (weights, optimizer state, their copies in another memory kind; on CPU also
the "device" arrays and XLA's temporaries) are memory fresh from the kernel, and filling 4 KiB
pages costs a page fault each: on CPU that bounds a copy into a fresh buffer at a fraction of the
memory's speed (docs/BENCHMARKS.md, "Huge pages"). glibc's malloc asks the kernel for 2 MiB pages
(``madvise(MADV_HUGEPAGE)``) when ``GLIBC_TUNABLES`` holds ``glibc.malloc.hugetlb=1``, and reads
that only when a process starts: so ``python -m mllm_rl.run`` and ``python -m mllm_rl.bench``
start themselves once more with it (``exec``: the same process id) where the kernel's THP mode is
``madvise`` (in ``always`` it gives huge pages anyway; in ``never`` none). ``MLLM_RL_HUGEPAGES=0``
leaves the allocator as it is.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from pathlib import Path

OFF_VAR = "MLLM_RL_HUGEPAGES"
TUNABLE = "glibc.malloc.hugetlb"
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``: the bracketed word), None
    where it is not readable (not Linux, no THP)."""
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def glibc_version() -> tuple[int, ...] | None:
    """This interpreter's glibc as a version tuple; None for another libc."""
    lib, version = platform.libc_ver()
    try:
        return tuple(int(x) for x in version.split(".")) if lib == "glibc" else None
    except ValueError:
        return None


def wanted(env: Mapping[str, str], mode: str | None, glibc: tuple[int, ...] | None) -> dict[str, str]:
    """``{"GLIBC_TUNABLES": ...}`` with the tunable added to ``env``'s, or {} (nothing to gain, or
    already set either way) on a host whose THP mode is ``mode`` and glibc ``glibc`` (None: not
    readable, another libc)."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if env.get(OFF_VAR, "1") == "0" or mode != "madvise" or glibc is None or glibc < (2, 35):
        return {}
    if TUNABLE in tunables:
        return {}
    return {"GLIBC_TUNABLES": f"{tunables}:{TUNABLE}=1" if tunables else f"{TUNABLE}=1"}


def in_effect(env: Mapping[str, str] = os.environ) -> bool:
    """Whether glibc was told to ask for huge pages when this process started."""
    return f"{TUNABLE}=1" in env.get("GLIBC_TUNABLES", "").split(":")


def state(env: Mapping[str, str] = os.environ) -> dict[str, object]:
    """What a run records: the kernel's THP mode and whether glibc asks for huge pages."""
    return {"thp_mode": thp_mode(), "glibc": in_effect(env)}


def restart_with_hugepages(module: str) -> None:
    """Run this process again as ``python ... -m module ...`` with ``wanted`` added (``exec``; no
    return), when it was started that way (``sys.orig_argv``: not a fork of another program) and
    glibc was not told; otherwise return."""
    add = wanted(os.environ, thp_mode(), glibc_version())
    argv = list(getattr(sys, "orig_argv", []))
    if not add or not any(argv[i : i + 2] == ["-m", module] for i in range(len(argv) - 1)):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, {**os.environ, **add})
    except OSError:  # the interpreter cannot be started again: run as it is
        return

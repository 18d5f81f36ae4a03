"""How the processes of a run agree (multi-task runs: at every lease handoff); no networking of our own.

``gather(name, value)``: a barrier carrying one string per process, all returned in process order
(from the backend's process group, e.g. ``jax.distributed``'s key-value store; one process: local)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Coordinator(Protocol):
    index: int  # this process
    count: int  # processes in the run

    def gather(self, name: str, value: str) -> list[str]:
        """Every process's ``value`` for ``name``, in process order (blocks until all gave one)."""


class LocalCoordinator:
    """One process: gathering is returning its own value."""

    index, count = 0, 1

    def gather(self, name: str, value: str) -> list[str]:
        return [value]


class ProcessCoordinator:
    """A ``Coordinator`` over a backend's process group: ``procs()`` gives this process now (an
    object with ``index`` and ``count``), ``gather(name, value)`` the backend's all-gather."""

    def __init__(self, procs: Callable[[], Any], gather: Callable[[str, str], list[str]]) -> None:
        self._procs, self._gather = procs, gather

    @property
    def index(self) -> int:
        return int(self._procs().index)

    @property
    def count(self) -> int:
        return int(self._procs().count)

    def gather(self, name: str, value: str) -> list[str]:
        return self._gather(name, value)


class ScheduleMismatch(RuntimeError):
    """Processes computed different lease schedules (e.g. different task files or checkpoints)."""


class HasCoordinator(Protocol):
    """What ``coordinator_for`` needs of a backend (``mllm_rl.backend.Backend.coordinator``)."""

    def coordinator(self) -> Coordinator | None: ...


def coordinator_for(backend: HasCoordinator) -> Coordinator:
    """The backend's coordinator when it has one and the run has several processes, else local."""
    coord = backend.coordinator()
    return coord if coord is not None and coord.count > 1 else LocalCoordinator()

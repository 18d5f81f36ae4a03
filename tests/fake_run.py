"""``python -m tests.fake_run ARGS``: ``python -m mllm_rl.run ARGS`` with ``--backend fake``
available (``tests/fake_backend.py``, a fake for tests), nothing else changed.

A test starts it as a subprocess, like a real run (``conftest.run_cli``), so exit codes, signals,
the watchdog's stack dumps and hard exit, and the report at exit behave as in one; it starts in
a second or two (no jax or torch import, no engine)."""

from __future__ import annotations

from mllm_rl import backend_registry

_registered = backend_registry.load_backend


def load_backend(name: str) -> backend_registry.Backend:
    """The registered backends, and ``fake``; imported here, once ``mllm_rl.run`` has set up its
    signal handling (which must happen before anything starts a thread: numpy's BLAS pool does)."""
    if name != "fake":
        return _registered(name)
    from tests.fake_backend import FakeRunBackend

    return FakeRunBackend()


if __name__ == "__main__":
    backend_registry.load_backend = load_backend
    from mllm_rl.run import _exit, main

    _exit(main())

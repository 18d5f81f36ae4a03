"""Find backends by name through the ``mllm_rl.backends`` entry-point group.

``--backend jax`` imports only the jax backend module; torch is never imported, and
vice versa.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from mllm_rl.backend import Backend

GROUP = "mllm_rl.backends"


def available_backends() -> list[str]:
    return sorted(ep.name for ep in entry_points(group=GROUP))


def load_backend(name: str) -> Backend:
    """The backend registered as ``name``; ``ValueError`` (one line) when there is none, it cannot
    be imported, or it is not a ``mllm_rl.backend.Backend``."""
    eps = {ep.name: ep for ep in entry_points(group=GROUP)}
    if name not in eps:
        have = ", ".join(sorted(eps)) or "none (is mllm-rl installed? run `make setup`)"
        raise ValueError(f"--backend {name!r}: not installed; available: {have}")
    try:
        cls = eps[name].load()
    except ImportError as e:
        raise ValueError(f"--backend {name!r}: cannot import ({e}); install the '{name}' extra") from None
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise ValueError(
            f"--backend {name!r}: entry point {eps[name].value} is not a mllm_rl.backend.Backend"
        )
    return cls()

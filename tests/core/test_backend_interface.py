"""The backend interface (``mllm_rl.backend.Backend``): what every backend declares, the defaults of
the optional capabilities, and the core using it as a type, never probing with ``getattr``."""

from __future__ import annotations

import ast
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

from mllm_rl import backend_registry
from mllm_rl.backend import Backend
from mllm_rl.coordination import LocalCoordinator, coordinator_for

ROOT = Path(__file__).resolve().parents[2]


class MinimalBackend(Backend):
    """Only the required methods: the optional capabilities keep their defaults."""

    name = "minimal"
    ready_phase = "minimal_ready"
    engines = {"auto": "none"}

    def init_runtime(self, tp: int = 1, platform: str = "auto") -> dict[str, Any]:
        return {"platform": "cpu"}

    def memory_probe(self) -> Any:
        return None

    def check_engine_args(self, model: Any, opts: Any) -> None:
        return None

    def create_engine(self, model: Any, opts: Any) -> Any:
        raise NotImplementedError

    def create_trainer(self, model: Any, cfg: Any) -> Any:
        raise NotImplementedError


def test_a_backend_without_the_optional_capabilities_is_one_process_with_nothing_to_free():
    b = MinimalBackend()
    assert b.init_distributed(tp=4) == {"process_index": 0, "process_count": 1}
    assert b.coordinator() is None
    assert isinstance(coordinator_for(b), LocalCoordinator)
    assert b.shutdown_distributed() is None and b.empty_cache() is None


def test_a_backend_missing_a_required_method_cannot_be_built():
    class NoTrainer(MinimalBackend):
        create_trainer = Backend.create_trainer  # back to the abstract declaration

    with pytest.raises(TypeError, match="create_trainer"):
        NoTrainer()


def test_the_jax_backend_is_a_complete_backend():
    b = backend_registry.load_backend("jax")
    assert isinstance(b, Backend) and not type(b).__abstractmethods__


def test_an_entry_point_that_is_not_a_backend_is_refused_in_one_line(monkeypatch):
    fake = EntryPoint(name="odd", value="collections:OrderedDict", group=backend_registry.GROUP)
    monkeypatch.setattr(backend_registry, "entry_points", lambda group: [fake])
    with pytest.raises(ValueError, match=r"^--backend 'odd': entry point collections:OrderedDict is not a "):
        backend_registry.load_backend("odd")


def _probes(path: Path, root: Path = ROOT) -> list[str]:
    """``getattr(backend, ...)`` / ``hasattr(backend, ...)`` calls in one file (``file:line``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and node.args
            and isinstance(node.args[0], ast.Name)
            and "backend" in node.args[0].id
        ):
            out.append(f"{path.relative_to(root)}:{node.lineno}")
    return out


def test_the_core_never_probes_a_backend_for_a_capability(tmp_path):
    found = [hit for p in sorted((ROOT / "mllm_rl").rglob("*.py")) for hit in _probes(p)]
    assert found == [], "declare the capability on mllm_rl.backend.Backend instead"
    probe = tmp_path / "probe.py"  # the scan finds one
    probe.write_text("def f(backend):\n    return getattr(backend, 'coordinator', None)\n")
    assert _probes(probe, tmp_path) == ["probe.py:2"]


def test_jax_on_a_gpu_allocates_on_demand_unless_the_user_said_otherwise():
    """JAX reserves 75% of a GPU at start by default; a colocated run must not (the engine sizes
    its pool from free memory and the plan counts what each phase holds): the run sets
    ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, a value the user set stays."""
    from mllm_rl.backends.jax import PREALLOCATE, gpu_allocates_on_demand

    env: dict[str, str] = {}
    gpu_allocates_on_demand(env)
    assert env == {PREALLOCATE: "false"}
    env = {PREALLOCATE: "true"}
    gpu_allocates_on_demand(env)
    assert env == {PREALLOCATE: "true"}

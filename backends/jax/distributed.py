"""Multi-process JAX (multi-host TPU slices; N local CPU processes in CI) through ``jax.distributed``.

Which processes form one run comes from the environment (``config_from_env``), first match wins:
``MLLM_RL_COORDINATOR`` (or ``JAX_COORDINATOR_ADDRESS``), ``MLLM_RL_NUM_PROCESSES`` and
``MLLM_RL_PROCESS_ID`` (all three or none); a multi-host Cloud TPU VM (detected); one process.

``init_distributed`` must run before any JAX backend exists. ``barrier`` / ``share`` / ``gather`` use
the coordination service's key-value store: processes agree without a device computation (which
would have to be issued by all in the same order and could race the engine's scheduler thread).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mllm_rl.coordination import ProcessCoordinator

ENV_COORDINATOR = "MLLM_RL_COORDINATOR"
ENV_NUM_PROCESSES = "MLLM_RL_NUM_PROCESSES"
ENV_PROCESS_ID = "MLLM_RL_PROCESS_ID"
ENV_ENGINE_PORT = "MLLM_RL_ENGINE_PORT"
ENV_TIMEOUT = "MLLM_RL_DIST_TIMEOUT_S"
JAX_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
DEFAULT_TIMEOUT_S = 600
_GOOGLE_PCI_VENDOR = "0x1ae0"  # jax._src.hardware_utils._GOOGLE_PCI_VENDOR_ID


@dataclasses.dataclass(frozen=True)
class DistConfig:
    """How this process joins a run: ``source`` is ``single``, ``env`` or ``tpu``."""

    source: str
    num_processes: int = 1
    process_id: int | None = 0  # None: detected by jax (Cloud TPU)
    coordinator: str | None = None  # None: detected by jax (Cloud TPU)
    timeout_s: int = DEFAULT_TIMEOUT_S


@dataclasses.dataclass(frozen=True)
class Procs:
    index: int = 0
    count: int = 1


_procs = Procs()  # this process in the run (kept after shutdown: records still need the index)
_joined = False  # jax.distributed is up (init_distributed joined a run, shutdown not yet called)
_timeout_s = DEFAULT_TIMEOUT_S
_seq: dict[str, int] = {}  # per-name call counters: every process calls barrier/share in the same order


def _int(env: Mapping[str, str], name: str, minimum: int) -> int:
    raw = env[name]
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={raw!r}: must be >= {minimum}")
    return value


def _host_port(name: str, raw: str) -> tuple[str, int]:
    host, sep, port = raw.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}={raw!r}: expected host:port of process 0 (e.g. 10.0.0.2:8476)")
    return host, int(port)


def _google_pci_device() -> bool:
    """A Google PCI device on this host: a cheap pre-filter for a TPU VM that needs no jax import."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() == _GOOGLE_PCI_VENDOR:
                return True
        except OSError:
            continue
    return False


def tpu_process_count() -> int | None:
    """Hosts of this Cloud TPU slice per jax's cluster detection; None off a Cloud TPU VM."""
    if not _google_pci_device():
        return None
    from jax._src import cloud_tpu_init, clusters

    if not cloud_tpu_init.running_in_cloud_tpu_vm:
        return None
    for env in (clusters.GkeTpuCluster, clusters.GceTpuCluster):
        if env.is_env_present():
            return int(env.get_process_count())
    return None


def config_from_env(
    env: Mapping[str, str] | None = None, tpu_probe: Callable[[], int | None] | None = tpu_process_count
) -> DistConfig:
    """Parse the environment (ValueError naming a bad variable); ``tpu_probe=None``: no TPU detection."""
    env = os.environ if env is None else env
    timeout = _int(env, ENV_TIMEOUT, 1) if env.get(ENV_TIMEOUT) else DEFAULT_TIMEOUT_S
    if env.get(ENV_ENGINE_PORT) and _int(env, ENV_ENGINE_PORT, 1) > 65529:
        raise ValueError(
            f"{ENV_ENGINE_PORT}={env[ENV_ENGINE_PORT]}: must be <= 65529 (sglang-jax binds port+5, port+6)"
        )
    coord_var = next((v for v in (ENV_COORDINATOR, JAX_COORDINATOR) if env.get(v)), None)
    ours = [v for v in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if env.get(v)]
    if coord_var is None and not ours:
        if tpu_probe is not None:
            n = tpu_probe()
            if n is not None and n > 1:
                return DistConfig("tpu", num_processes=n, process_id=None, timeout_s=timeout)
        return DistConfig("single", timeout_s=timeout)
    given = f"{coord_var or ours[0]} is set"
    for var in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID):
        if var == ENV_COORDINATOR and coord_var is not None:
            continue
        if not env.get(var):
            raise ValueError(
                f"{var} is not set ({given}; a multi-process run needs {ENV_COORDINATOR}, "
                f"{ENV_NUM_PROCESSES} and {ENV_PROCESS_ID})"
            )
    coordinator = env[coord_var]
    _host_port(coord_var, coordinator)
    n = _int(env, ENV_NUM_PROCESSES, 1)
    i = _int(env, ENV_PROCESS_ID, 0)
    if i >= n:
        raise ValueError(f"{ENV_PROCESS_ID}={i}: must be < {ENV_NUM_PROCESSES}={n}")
    return DistConfig("env", num_processes=n, process_id=i, coordinator=coordinator, timeout_s=timeout)


def force_cpu_devices(n: int) -> None:
    """``n`` fake CPU devices (XLA_FLAGS; read when the CPU backend starts), unless already set."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def init_distributed(tp: int = 1, env: Mapping[str, str] | None = None) -> dict[str, int]:
    """Join the run the environment describes (``jax.distributed.initialize``; on CPU gloo and
    ``tp // num_processes`` devices each); ``{"process_index", "process_count"}``."""
    global _procs, _joined, _timeout_s
    cfg = config_from_env(env)
    _timeout_s = cfg.timeout_s
    if cfg.source == "single":
        return {"process_index": 0, "process_count": 1}
    if _joined:  # idempotent
        return {"process_index": _procs.index, "process_count": _procs.count}
    if cfg.source == "env":
        if tp % cfg.num_processes:
            raise ValueError(
                f"--tp {tp} with {ENV_NUM_PROCESSES}={cfg.num_processes}: the engine's mesh "
                "spans every process's devices, so --tp must be a multiple of "
                f"{cfg.num_processes}"
            )
        force_cpu_devices(tp // cfg.num_processes)  # CPU only; on TPU/GPU the hardware decides
    import jax
    from jax._src import distributed as jax_dist
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("init_distributed: a JAX backend is already initialised; it must run first")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = f"process {cfg.process_id} of {cfg.num_processes}, coordinator {cfg.coordinator}"
    if cfg.source == "tpu":
        where = f"Cloud TPU slice of {cfg.num_processes} hosts, auto-detected"
    args: tuple[Any, ...] = ()
    if cfg.source == "env":
        args = (cfg.coordinator, cfg.num_processes, cfg.process_id)
        if cfg.process_id:  # jaxlib aborts (exit 134) when it cannot connect
            _wait_for_coordinator(cfg.coordinator or "", cfg.timeout_s)
    try:
        jax.distributed.initialize(*args, initialization_timeout=cfg.timeout_s)
    except Exception as e:  # jaxlib raises its own error types (DEADLINE_EXCEEDED, ...)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(f"jax.distributed.initialize ({where}) failed: {first}") from None
    state = jax_dist.global_state
    _procs = Procs(index=int(state.process_id), count=int(state.num_processes))
    _joined = True
    return {"process_index": _procs.index, "process_count": _procs.count}


def _wait_for_coordinator(coordinator: str, timeout_s: float) -> None:
    """Until process 0's coordination service accepts connections (RuntimeError after ``timeout_s``)."""
    host, port = _host_port(ENV_COORDINATOR, coordinator)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=5):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"coordinator {coordinator}: nothing accepted a connection within "
                    f"{timeout_s}s ({e}); is process 0 running there?"
                ) from None
            time.sleep(0.5)


def procs() -> Procs:
    """This process's index and the process count (1 until ``init_distributed`` joined a run)."""
    return _procs


def _client() -> Any:
    from jax._src import distributed as jax_dist

    client = jax_dist.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialised")
    return client


def _key(name: str) -> str:
    n = _seq.get(name, 0)
    _seq[name] = n + 1
    return f"mllm_rl/{name}/{n}"


def _wait(key: str, timeout_s: float | None, missing: str, fn: Callable[[int], Any]) -> Any:
    """``fn(timeout in ms)``; its failure as RuntimeError ``key: <missing> within <timeout>s``."""
    timeout = timeout_s or _timeout_s
    try:
        return fn(int(1000 * timeout))
    except Exception as e:
        raise RuntimeError(f"{key}: {missing} within {timeout}s ({e})") from None


def barrier(name: str, timeout_s: float | None = None) -> None:
    """Wait until every process reached the ``n``-th ``barrier(name)`` (no device computation)."""
    if _procs.count == 1:
        return
    key = _key(f"barrier/{name}")
    _wait(key, timeout_s, "not every process arrived", lambda ms: _client().wait_at_barrier(key, ms))


def share(name: str, value: str | None, timeout_s: float | None = None) -> str:
    """Process 0 publishes ``value`` for the ``n``-th ``share(name)``; every process returns it."""
    key = _key(f"share/{name}")
    if _procs.count == 1:
        assert value is not None
        return value
    client = _client()
    if _procs.index == 0:
        assert value is not None, "process 0 must provide the value"
        client.key_value_set(key, value)
        return value
    get = lambda ms: str(client.blocking_key_value_get(key, ms))  # noqa: E731
    return _wait(key, timeout_s, "nothing from process 0", get)


def gather(name: str, value: str, timeout_s: float | None = None) -> list[str]:
    """Every process's ``value`` for the ``n``-th ``gather(name)``, in process order."""
    if _procs.count == 1:
        return [value]
    key, client = _key(f"gather/{name}"), _client()
    client.key_value_set(f"{key}/{_procs.index}", value)
    get = lambda ms: [str(client.blocking_key_value_get(f"{key}/{i}", ms)) for i in range(_procs.count)]  # noqa: E731
    return _wait(key, timeout_s, "not every process arrived", get)


def coordination() -> ProcessCoordinator:
    """``mllm_rl.coordination.Coordinator`` over ``jax.distributed``'s key-value store."""
    return ProcessCoordinator(procs, gather)


def agree_on_platform(platform: str) -> None:
    """RuntimeError unless every process's jax came up on the same platform (a busy TPU falls back to CPU)."""
    if _procs.count == 1:
        return
    client = _client()
    client.key_value_set(f"mllm_rl/platform/{_procs.index}", platform)
    timeout_ms = int(1000 * _timeout_s)
    seen = {
        i: str(client.blocking_key_value_get(f"mllm_rl/platform/{i}", timeout_ms))
        for i in range(_procs.count)
    }
    if len(set(seen.values())) > 1:
        desc = ", ".join(f"process {i}: {p}" for i, p in seen.items())
        raise RuntimeError(f"processes came up on different platforms ({desc})")


def engine_address(port: int | None = None) -> str:
    """``ip:port`` for sglang-jax's ``dist_init_addr``: the coordinator's host as an IPv4 address
    (ZMQ binds addresses); port ``port``, else ``MLLM_RL_ENGINE_PORT`` or the coordinator's + 1."""
    from jax._src import distributed as jax_dist

    coordinator = jax_dist.global_state.coordinator_address
    if not coordinator:
        raise RuntimeError("jax.distributed is not initialised: no coordinator address")
    host, coord_port = _host_port("coordinator", coordinator)
    try:
        host = socket.gethostbyname(host)
    except OSError:
        pass  # an IPv6 literal or an unresolvable name: sglang-jax gets it as given
    engine_port = port if port is not None else int(os.environ.get(ENV_ENGINE_PORT) or coord_port + 1)
    return f"{host}:{engine_port}"


def shutdown() -> None:
    """Leave the run (idempotent); every process must, or the others abort."""
    global _joined
    if _joined:
        import jax

        _joined = False
        jax.distributed.shutdown()

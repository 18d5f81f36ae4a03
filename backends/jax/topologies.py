"""Compile-only device topologies the JAX planner compiles for: TPU slices, NVIDIA GPUs, the local CPU.

No accelerator is needed: ``get_topology_desc`` gives devices to compile for, with the compiler
from ``libtpu`` or the ``jax-cuda12-plugin`` wheels in ``<venv>/plan-compilers`` (``scripts/venv.sh``),
on ``sys.path`` for the planner only (JAX loads every installed plugin at start-up). Call
``prepare(spec)`` before jax is imported, then ``devices(spec)``. Device memory per target:

- TPU: what libtpu's compiler allows (it rejects any program that does not fit).
- GPU: ``device_memory_size`` of the XLA target config in ``mllm_rl/assets/gpu_targets`` (XLA does
  not reject a program that does not fit: the plan compares).
- CPU: a share of the available host RAM (``mllm_rl.memplan.cpu_budget``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import warnings
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from mllm_rl.memplan.compose import GIB, Target

COMPILERS_ENV = "MLLM_RL_PLAN_COMPILERS"


@dataclasses.dataclass(frozen=True)
class TargetSpec:
    name: str
    platform: str  # "tpu" | "gpu" | "cpu"
    topology: str = ""  # TPU: "v4:2x2x1"; GPU: "1x1x8" (slices x hosts x devices per host)
    chips_per_host_bounds: tuple[int, int, int] | None = None
    chip_config_name: str | None = None  # "megacore" for v4/v5p (one device per chip)
    accelerator_type: str = ""  # TPU_ACCELERATOR_TYPE libtpu expects
    gpu_config: str = ""  # file in mllm_rl/assets/gpu_targets
    note: str = ""  # what ``--target`` lists


def _tpu(
    name: str, topo: str, bounds: tuple[int, int, int], accel: str, megacore: bool = False
) -> TargetSpec:
    note = f"TPU {topo} ({accel}), libtpu compile-only topology"
    return TargetSpec(name, "tpu", topo, bounds, "megacore" if megacore else None, accel, note=note)


def _gpu(name: str, topo: str, config: str) -> TargetSpec:
    note = f"GPU {topo} (slices x hosts x devices), XLA target config {config}"
    return TargetSpec(name, "gpu", topo, gpu_config=config, note=note)


TARGETS: dict[str, TargetSpec] = {
    s.name: s
    for s in (
        _tpu("v4-8", "v4:2x2x1", (2, 2, 1), "v4-8", megacore=True),
        _tpu("v4-16", "v4:2x2x2", (2, 2, 1), "v4-16", megacore=True),
        _tpu("v4-32", "v4:2x2x4", (2, 2, 1), "v4-32", megacore=True),
        _tpu("v5e-4", "v5e:2x2", (2, 2, 1), "v5litepod-4"),
        _tpu("v5e-8", "v5e:2x4", (2, 4, 1), "v5litepod-8"),
        _tpu("v5e-16", "v5e:4x4", (2, 4, 1), "v5litepod-16"),
        _tpu("v5p-8", "v5p:2x2x1", (2, 2, 1), "v5p-8", megacore=True),
        _tpu("v5p-16", "v5p:2x2x2", (2, 2, 1), "v5p-16", megacore=True),
        _tpu("v6e-4", "v6e:2x2", (2, 2, 1), "v6e-4"),
        _tpu("v6e-8", "v6e:2x4", (2, 4, 1), "v6e-8"),
        _gpu("h100x1", "1x1x1", "h100_sxm.txtpb"),
        _gpu("h100x8", "1x1x8", "h100_sxm.txtpb"),
        _gpu("h100x16", "1x2x8", "h100_sxm.txtpb"),
        _gpu("h200x1", "1x1x1", "h200.txtpb"),
        _gpu("h200x8", "1x1x8", "h200.txtpb"),
        _gpu("h200x16", "1x2x8", "h200.txtpb"),
        TargetSpec("cpu", "cpu", note="the local CPU devices (the host's RAM)"),
    )
}


def describe() -> dict[str, str]:
    """Target name -> one line (what ``--target`` accepts)."""
    return {s.name: s.note for s in TARGETS.values()}


def spec(name: str) -> TargetSpec:
    if name not in TARGETS:
        raise ValueError(f"--target {name!r}: unknown; choose one of {', '.join(TARGETS)}")
    return TARGETS[name]


def compilers_dir() -> Path:
    """Where ``scripts/venv.sh`` installs libtpu and the CUDA plugin for planning."""
    return Path(os.environ.get(COMPILERS_ENV) or Path(sys.prefix) / "plan-compilers")


def _compilers_on_path() -> Path:
    d = compilers_dir()
    if d.is_dir() and str(d) not in sys.path:
        sys.path.insert(0, str(d))
    return d


def prepare(s: TargetSpec, cpu_devices: int = 1) -> None:
    """Before jax is imported: JAX on its CPU platform, the compilers on ``sys.path``, libtpu's
    environment. RuntimeError if jax was imported otherwise; ValueError if no compiler is installed."""
    if "jax" in sys.modules:
        import jax

        if s.platform == "cpu":
            return
        _compilers_on_path()
        have = jax.config.jax_platforms
        if have not in ("cpu", None) or not _plugin_importable(s):
            raise RuntimeError(f"--target {s.name}: jax was imported before the planner set it up")
        if have is None:  # imported, no backend started yet: keep it off the accelerator plugins
            jax.config.update("jax_platforms", "cpu")
        _libtpu_env(s)  # libtpu reads it when first loaded, after this
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    if s.platform == "cpu":
        if cpu_devices > 1:
            from mllm_rl.backends.jax.distributed import force_cpu_devices

            force_cpu_devices(cpu_devices)
        return
    d = _compilers_on_path()
    if not _plugin_importable(s):
        what = "libtpu" if s.platform == "tpu" else "jax_cuda12_plugin (or jax_cuda13_plugin)"
        raise ValueError(
            f"--target {s.name}: {what} is not installed (scripts/venv.sh jax installs it into {d}; "
            f"or pip install --no-deps --target {d} the pins of the 'tpu'/'gpu-plan' extras)"
        )
    _libtpu_env(s)


def _libtpu_env(s: TargetSpec) -> None:
    """What libtpu reads when it loads, for a compile-only TPU target: no metadata server, one local
    host, and no claim on ``/tmp/libtpu_lockfile`` (another planner may hold libtpu at once)."""
    if s.platform == "tpu":
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", s.accelerator_type)
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def _plugin_importable(s: TargetSpec) -> bool:
    """The target's compiler is importable: libtpu, or JAX's CUDA 12 or 13 plugin."""
    import importlib.util

    names = ("libtpu",) if s.platform == "tpu" else ("jax_cuda12_plugin", "jax_cuda13_plugin")
    return any(importlib.util.find_spec(n) is not None for n in names)


# ``jax.Device.device_kind`` per generation (tests/jax/test_run_plan_target.py checks them); a GPU
# kind is a prefix of a driver's card name.
DEVICE_KINDS = {
    "v4": "TPU v4",
    "v5e": "TPU v5 lite",
    "v5p": "TPU v5",
    "v6e": "TPU v6 lite",
    "h100": "NVIDIA H100 80GB HBM3",
    "h200": "NVIDIA H200",
}


def shape(s: TargetSpec) -> tuple[str, int, int]:
    """``(device kind, devices, hosts)`` of a TPU or GPU target from its spec: TPU ``v4:2x2x2`` is 8
    chips of one device each over chips / chips-per-host hosts; GPU ``1x2x8`` is 2 hosts of 8."""
    import math

    dims = [int(x) for x in s.topology.split(":")[-1].split("x")]
    if s.platform == "tpu":
        chips = math.prod(dims)
        per_host = math.prod(s.chips_per_host_bounds or (1,))
        return DEVICE_KINDS[s.topology.split(":")[0]], chips, max(1, chips // per_host)
    return DEVICE_KINDS[s.name.split("x")[0]], dims[1] * dims[2], dims[1]


def match_runtime(platform: str, device_kind: str, num_devices: int, processes: int) -> str | None:
    """The target whose devices (kind, count over all processes, hosts) are a run's, or None."""
    for name, s in TARGETS.items():
        if s.platform != platform:
            continue
        kind, n, hosts = shape(s)
        same_kind = device_kind == kind if platform == "tpu" else device_kind.startswith(kind)
        if same_kind and (n, hosts) == (num_devices, processes):
            return name
    return None


def check_trainer_mesh(
    trainer_tp: int, fsdp: int, devices: int, heads: int, kv_heads: int, of: str = ""
) -> None:
    """The trainer's ``("fsdp", "tp")`` mesh: ``--trainer-tp`` divides the ``devices`` and the heads,
    ``--fsdp`` is the rest (0 says so); ValueError naming the flag. ``of``: the target's name."""
    where = f"{devices} devices" + (f" of {of}" if of else "")
    if devices % trainer_tp:
        raise ValueError(f"--trainer-tp {trainer_tp} does not divide the {where}")
    if fsdp not in (0, devices // trainer_tp):
        raise ValueError(
            f"--fsdp {fsdp}: the trainer's mesh is fsdp x tp = every device; with --trainer-tp "
            f"{trainer_tp} on {where} fsdp is {devices // trainer_tp} (0 says so)"
        )
    if heads % trainer_tp or kv_heads % trainer_tp:
        raise ValueError(
            f"--trainer-tp {trainer_tp}: {heads} heads / {kv_heads} kv heads are not divisible by it"
        )


def gpu_config_text(s: TargetSpec) -> str:
    return resources.files("mllm_rl").joinpath("assets", "gpu_targets", s.gpu_config).read_text()


def devices(s: TargetSpec) -> tuple[list[Any], Target]:
    """The devices to compile for and the ``Target`` (device memory and where it comes from)."""
    import jax

    if s.platform == "cpu":
        from mllm_rl.memplan.cpu_budget import cpu_device_bytes

        devs = jax.devices("cpu")
        budget, source, total = cpu_device_bytes()
        return devs, Target(
            "cpu", "cpu", len(devs), 1, budget, "CPU", f"{source}; shared by the CPU devices", total
        )
    devs = topology_devices(s)
    if s.platform == "tpu":
        hbm = _tpu_hbm(devs)
        src = f"libtpu {libtpu_version()} compiler limit"
    else:
        text = gpu_config_text(s)
        m = re.search(r"device_memory_size:\s*(\d+)", text)
        if not m:
            raise RuntimeError(f"{s.gpu_config}: no device_memory_size")
        hbm = int(m.group(1))
        src = f"XLA GPU target config {s.gpu_config} (device_memory_size)"
    hosts = len({d.process_index for d in devs})
    return devs, Target(s.name, s.platform, len(devs), hosts, hbm, devs[0].device_kind, src)


def topology_devices(s: TargetSpec) -> list[Any]:
    """The compile-only devices of a TPU or GPU target (``prepare`` first)."""
    from jax.experimental import topologies

    if s.platform == "tpu":
        kw: dict[str, Any] = {"chips_per_host_bounds": s.chips_per_host_bounds, "num_slices": 1}
        if s.chip_config_name:
            kw["chip_config_name"] = s.chip_config_name
        desc = topologies.get_topology_desc(platform="tpu", topology_name=s.topology, **kw)
    else:
        kw = {"topology": s.topology, "target_config": gpu_config_text(s)}
        desc = topologies.get_topology_desc(platform="cuda", topology_name="", **kw)
    return list(desc.devices)


@contextlib.contextmanager
def cache_writes(on: bool) -> Iterator[None]:
    """Unless ``on``, JAX's compilation cache writes nothing in the block (unreadable-entry warnings
    silenced): a compile-only client's executables cannot be read back anyway."""
    if on:
        yield
        return
    import jax

    key = "jax_persistent_cache_min_compile_time_secs"
    was = getattr(jax.config, key)
    jax.config.update(key, 1e12)  # no compile takes that long: nothing is written
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
            yield
    finally:
        jax.config.update(key, was)


def libtpu_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("libtpu")
    except PackageNotFoundError:
        return "?"


_HBM_RE = re.compile(r"available HBM \(([\d.]+)([GM])\)")
_USED_RE = re.compile(r"(?:required for HLO temporaries|Used) \(?([\d.]+)([GMK])\)?")
_UNIT = {"G": GIB, "M": 2**20, "K": 2**10}


def _tpu_hbm(devs: list[Any]) -> int:
    """The HBM libtpu's compiler allows one device, from its refusal of a 1 TiB program."""
    import jax
    import jax.numpy as jnp

    dev = jax.sharding.SingleDeviceSharding(devs[0])
    x = jax.ShapeDtypeStruct((2**38,), jnp.float32, sharding=dev)
    try:
        jax.jit(lambda a: a * 2).lower(x).compile()
    except Exception as e:  # noqa: BLE001 - the message is what we want
        m = _HBM_RE.search(str(e))
        if m:
            return int(float(m.group(1)) * _UNIT[m.group(2)])
        raise RuntimeError(f"libtpu did not report its HBM: {str(e).splitlines()[0][:200]}") from None
    raise RuntimeError("libtpu compiled a 1 TiB program for one device; cannot read its HBM")


def rejection(e: BaseException) -> tuple[str, int] | None:
    """``(first line, bytes it needed or 0)`` when ``e`` is the compiler refusing a program that
    does not fit (``RESOURCE_EXHAUSTED``), else None."""
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    line = next((ln.strip() for ln in text.splitlines() if "memory" in ln.lower() or "hbm" in ln.lower()), "")
    m = _USED_RE.search(text)
    need = int(float(m.group(1)) * _UNIT[m.group(2)]) if m else 0
    return (line or text.splitlines()[0])[:300], need

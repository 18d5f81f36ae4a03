"""The trainer's device mesh and its sharding rules, by parameter name.

The mesh is 2-D, ``("fsdp", "tp")``: ``tp`` devices split each matmul (Megatron style), ``fsdp``
devices hold a slice of every weight along the other axis and each a slice of the batch.

Rules, for a kernel stored ``(in, out)`` (a leading layer axis [L] is never split; a mesh axis that
does not divide its dimension is dropped):

==========================  =========================  ==========================
leaf                        column-parallel             row-parallel
                            (q, k, v, gate, up)         (o, down)
==========================  =========================  ==========================
``kernel`` [in, out]        ``("fsdp", "tp")``          ``("tp", "fsdp")``
``lora_a`` [in, R]          ``("fsdp", None)``          ``("tp", None)``
``lora_b`` [R, out]         ``(None, "tp")``            ``(None, "fsdp")``
==========================  =========================  ==========================

``embed_tokens`` / ``lm_head`` [V, H]: ``("fsdp", "tp")`` (a lower TPU peak than the hidden axis
over ``fsdp``). Norm weights and scalars: replicated. Optimizer state leaves follow their parameter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("fsdp", "tp")
COLUMN = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
ROW = frozenset({"o_proj", "down_proj"})


def make_mesh(tp: int = 1, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``("fsdp", "tp")`` mesh of ``devices`` (default: every device), ``fsdp = n / tp``."""
    devs = list(jax.devices() if devices is None else devices)
    if tp < 1 or len(devs) % tp:
        raise ValueError(f"tp={tp} must be >= 1 and divide the {len(devs)} devices")
    return Mesh(np.array(devs).reshape(len(devs) // tp, tp), AXES)


def _names(path: tuple[Any, ...]) -> list[str]:
    keys = (getattr(k, "key", getattr(k, "name", None)) for k in path)
    return [k for k in keys if isinstance(k, str)]


def param_spec(path: tuple[Any, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """The ``PartitionSpec`` of the leaf at tree ``path`` (``jax.tree_util`` keys) of ``shape``."""
    names = _names(path)
    if len(shape) < 2:
        return P()
    leaf = next((n for n in reversed(names) if n in ("kernel", "lora_a", "lora_b")), None)
    proj = next((n for n in reversed(names) if n in COLUMN or n in ROW), None)
    if "embed_tokens" in names or "lm_head" in names:
        axes: tuple[str | None, ...] = ("fsdp", "tp")
    elif leaf is None or proj is None:  # e.g. stacked norm weights [L, H]
        return P()
    else:
        col = proj in COLUMN
        axes = {
            "kernel": ("fsdp", "tp") if col else ("tp", "fsdp"),
            "lora_a": ("fsdp", None) if col else ("tp", None),
            "lora_b": (None, "tp") if col else (None, "fsdp"),
        }[leaf]
    lead = (None,) * (len(shape) - 2)  # stacked layers [L, in, out]: L never split
    dims = shape[len(lead) :]
    fitted = tuple(
        a if a is None or (mesh.shape[a] > 1 and d % mesh.shape[a] == 0) else None
        for a, d in zip(axes, dims, strict=True)
    )
    return P(*lead, *fitted)


def tree_shardings(tree: Any, mesh: Mesh) -> Any:
    """A ``NamedSharding`` for every leaf of ``tree`` (params or optimizer state), by name."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(path, tuple(x.shape), mesh)), tree
    )


def data_rows(mesh: Mesh, rows: int) -> int:
    """The rows a micro-batch is padded to: a multiple of ``fsdp`` (padding rows carry no loss)."""
    n = mesh.shape["fsdp"]
    return -(-rows // n) * n


def batch_sharding(mesh: Mesh, rows: int) -> NamedSharding:
    """Rows of a micro-batch split over ``fsdp`` when they divide, else replicated."""
    n = mesh.shape["fsdp"]
    return NamedSharding(mesh, P("fsdp") if n > 1 and rows % n == 0 else P())


def on_cpu(sharding: jax.sharding.Sharding, one: bool = False) -> bool:
    """Every device of ``sharding`` a CPU (``one``: and only one device)."""
    devices = sharding.device_set
    return all(d.platform == "cpu" for d in devices) and (len(devices) == 1 or not one)

"""Copy-bandwidth baselines: raw host-to-device, device-to-host and on-device copies of one buffer.

    python -m mllm_rl.bench copy --backend jax|torch --mb 1024 [--platform auto] [--repeats 5]

prints one JSON object: what a raw copy costs here, what the weight swaps and release/resume
(with CPU backup) are compared against.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from mllm_rl.bench import MiB
from mllm_rl.bench.child import BenchError, bench_argv, flags, run_json
from mllm_rl.bench.cli import positive
from mllm_rl.hugepages import in_effect


def _bw(nbytes: int, fn: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Best and median seconds and GB/s of ``repeats`` calls of ``fn`` after a warm-up (first-touch
    page faults, allocator growth, kernel load)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    best, med = min(times), statistics.median(times)
    return {"seconds_best": round(best, 6), "seconds_median": round(med, 6),
            "gbps_best": round(nbytes / best / 1e9, 3), "gbps_median": round(nbytes / med / 1e9, 3)}  # fmt: skip


def baseline(backend: str, nbytes: int, platform: str, repeats: int, timeout: float | None,
             python: str = sys.executable, mb: float | None = None) -> dict[str, Any]:  # fmt: skip
    """This bench in a child under ``python``: copies of ``nbytes`` (clamped to [64, 4096] MiB;
    ``mb``: that many MiB instead), what another bench's rates are divided by."""
    mb = mb or round(min(4096.0, max(64.0, nbytes / MiB)), 1)
    cmd = bench_argv(
        "copy", *flags(backend=backend, mb=mb, platform=platform, repeats=repeats), python=python
    )
    return run_json(cmd, f"copy baseline ({backend})", timeout=timeout)


def jax_copy_bandwidth(
    nbytes: int, repeats: int = 5, kinds: Sequence[str] = ("h2d", "d2h", "d2d")
) -> dict[str, Any]:
    """JAX: ``h2d`` = ``device_put`` of a pageable numpy buffer (new device buffer each time),
    ``d2h`` = ``device_get`` into a new numpy array, ``d2d`` = an on-device copy (``jnp.copy``).
    On JAX CPU every one of them is a host memcpy."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    dev = jax.devices()[0]
    host = np.full(nbytes, 1, np.uint8)  # touched: no first-touch faults inside the timing
    out: dict[str, Any] = {"runtime": "jax", "platform": dev.platform, "device": str(dev), "bytes": nbytes}
    on_dev = jax.device_put(host, dev)
    on_dev.block_until_ready()
    copy = jax.jit(jnp.copy)

    def done(a: Any) -> None:  # a new device buffer: wait for it, then free it
        a.block_until_ready()
        a.delete()

    fns = {"h2d": lambda: done(jax.device_put(host, dev)), "d2h": lambda: np.array(on_dev, copy=True),
           "d2d": lambda: done(copy(on_dev))}  # fmt: skip
    out.update({k: _bw(nbytes, fns[k], repeats) for k in kinds})
    on_dev.delete()
    return out


def torch_copy_bandwidth(nbytes: int, device: str = "auto", repeats: int = 5,
                         kinds: Sequence[str] = ("h2d", "h2d_pinned", "d2h", "d2d")) -> dict[str, Any]:  # fmt: skip
    """torch: ``h2d`` = ``tensor.to(device)`` from pageable host memory, ``h2d_pinned`` = the same
    from pinned memory (CUDA only), ``d2h`` = ``.to("cpu")``, ``d2d`` = ``clone()`` on the device.
    On CPU ``.to("cpu")`` is a no-op, so ``h2d``/``d2h``/``d2d`` are a host ``clone()`` (memcpy)."""
    import torch

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    host = torch.ones(nbytes, dtype=torch.uint8)
    out: dict[str, Any] = {"runtime": "torch", "platform": dev.type, "bytes": nbytes,
                           "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}  # fmt: skip
    on_dev = host.to(dev) if cuda else host.clone()
    sync()

    def synced(copy: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            y = copy()
            sync()
            del y

        return run

    fns: dict[str, Callable[[], Any]] = {"h2d": synced(lambda: host.to(dev) if cuda else host.clone()),
        "d2h": lambda: on_dev.to("cpu") if cuda else on_dev.clone(), "d2d": synced(on_dev.clone)}  # fmt: skip
    if cuda and "h2d_pinned" in kinds:
        pinned = host.pin_memory()
        fns["h2d_pinned"] = synced(lambda: pinned.to(dev, non_blocking=True))
    not_measured = {"not_measured": "pinned host memory needs CUDA"}
    out.update({k: _bw(nbytes, fns[k], repeats) if k in fns else not_measured for k in kinds})
    fns.clear()  # drops the closures' device buffers
    if cuda:
        torch.cuda.empty_cache()
    return out


def copy_bandwidth(backend: str, nbytes: int, platform_: str = "auto", repeats: int = 5) -> dict[str, Any]:
    """The copy baselines of ``backend`` (``jax`` or ``torch``) for a buffer of ``nbytes``."""
    if backend == "jax":
        if platform_ == "cpu":
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        out = jax_copy_bandwidth(nbytes, repeats)
    elif backend == "torch":
        out = torch_copy_bandwidth(nbytes, "cpu" if platform_ == "cpu" else "auto", repeats)
    else:
        raise BenchError(f"--backend {backend!r}: choose jax or torch")
    out["hugepages"] = in_effect()  # fresh buffers in 2 MiB pages: several times the rate on CPU
    if out["platform"] == "cpu":
        out["note"] = ("CPU: every copy is a host-to-host memcpy; there is no host-to-device link, so "
                       "ratios against it are not H2D efficiencies")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m mllm_rl.bench copy``: print the copy baselines as one JSON line; 2 on bad input."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", required=True, choices=["jax", "torch"])
    ap.add_argument("--mb", type=positive(float), default=1024.0, help="buffer size, MiB")
    ap.add_argument("--platform", default="auto", choices=["auto", "cpu", "gpu", "cuda", "tpu"])
    ap.add_argument("--repeats", type=positive(int), default=5)
    args = ap.parse_args(argv)
    try:
        out = copy_bandwidth(args.backend, int(args.mb * MiB), args.platform, args.repeats)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(out), flush=True)
    return 0

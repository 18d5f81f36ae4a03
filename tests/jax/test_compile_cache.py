"""JAX's persistent compilation cache is on for every run unless the caller chose otherwise
(``backends/jax/compile_cache.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from mllm_rl.backends.jax import compile_cache


def test_unset_the_cache_goes_under_the_project_cache_and_is_trimmed_not_bounded_by_jax(tmp_path):
    """Our directory, trimmed when the run starts: no ``JAX_COMPILATION_CACHE_MAX_SIZE``, whose
    eviction lists and reads the whole directory on every write."""
    env = {"MLLM_RL_CACHE": str(tmp_path)}
    d = tmp_path / "jax-compile"
    d.mkdir()
    for i in range(8):  # 8 programs of 1 MiB, program 0 used longest ago
        f = d / f"k{i}-cache"
        f.write_bytes(b"x" * 2**20)
        os.utime(f, (1000 + i, 1000 + i))
    (d / "notes.txt").write_bytes(b"x" * 2**22)  # not an entry: never counted or deleted
    (d / "k0-atime").write_bytes(b"t")  # JAX's record of k0's last use: goes with it
    was = compile_cache.DEFAULT_MAX_BYTES
    compile_cache.DEFAULT_MAX_BYTES = 6 * 2**20
    try:
        assert compile_cache.configure(env) == str(d)
    finally:
        compile_cache.DEFAULT_MAX_BYTES = was
    assert env == {"MLLM_RL_CACHE": str(tmp_path), compile_cache.DIR: str(d)}
    # over 6 MiB: the oldest go until 4.5 MiB are left
    assert sorted(f.name for f in d.iterdir()) == [
        "k4-cache",
        "k5-cache",
        "k6-cache",
        "k7-cache",
        "notes.txt",
    ]
    assert compile_cache.trim(d, 6 * 2**20) == 0  # within the bound: nothing goes
    assert compile_cache.trim(tmp_path / "missing", 1) == 0


def test_a_callers_choice_is_kept_and_empty_turns_the_cache_off(tmp_path):
    env = {compile_cache.DIR: str(tmp_path / "mine")}
    assert compile_cache.configure(env) == str(tmp_path / "mine")
    assert compile_cache.MAX_SIZE not in env  # their directory, their policy
    off = {compile_cache.DIR: ""}
    assert compile_cache.configure(off) is None and off == {compile_cache.DIR: ""}


def test_the_backend_sets_it_before_jax_is_imported(tmp_path):
    """In a fresh process: loading the backend (what ``run`` and ``memplan`` do first) is enough for
    the jax imported afterwards, the plan's compiles included, to use the cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["MLLM_RL_CACHE"] = str(tmp_path)
    code = ("from mllm_rl.backend_registry import load_backend; load_backend('jax'); import jax; "
            "print(jax.config.jax_compilation_cache_dir)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(tmp_path / "jax-compile")]


def test_a_compile_only_targets_programs_are_not_written_and_old_ones_do_not_warn():
    """A TPU target's devices on this host belong to a compile-only client: its executables are
    written to the cache but cannot be read back, so a plan (``topologies.cache_writes(False)``)
    writes none, and reads an unreadable one written before without a warning. Outside the block
    the same compile is written (the cache is on in this process: the suite's)."""
    import random
    import warnings

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from mllm_rl.backends.jax import topologies
    from tests.conftest import needs_libtpu

    needs_libtpu()
    spec = topologies.spec("v4-8")
    topologies.prepare(spec)
    devs = topologies.topology_devices(spec)
    x = jax.ShapeDtypeStruct(
        (256, 256), np.float32, sharding=NamedSharding(Mesh(np.array(devs), ("x",)), PartitionSpec("x"))
    )
    c = random.random()  # a program no earlier run of the suite compiled
    cache = Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    name = f"cache_probe_{random.randrange(1 << 40)}"  # its entries only: other workers share the cache

    def times_c() -> Any:  # a new function each time: one object would hit JAX's in-memory cache
        f = lambda a: a * c  # noqa: E731
        f.__name__ = name
        return jax.jit(f)

    def entries() -> set[str]:
        return {p.name for p in cache.glob(f"jit_{name}-*")}

    before = entries()
    with topologies.cache_writes(False):
        times_c().lower(x).compile()
    assert entries() == before
    times_c().lower(x).compile()  # written: and unreadable by the next compile
    assert len(entries() - before) == 1
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with topologies.cache_writes(False):
            times_c().lower(x).compile()
        times_c().lower(x).compile()  # the warning the block keeps quiet
    assert len([w for w in said if "persistent compilation cache" in str(w.message)]) == 1
    assert jax.config.jax_persistent_cache_min_compile_time_secs < 1e12  # restored

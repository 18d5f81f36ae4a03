"""JAX's persistent compilation cache is on for every run unless the caller chose otherwise
(``backends/jax/compile_cache.py``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from mllm_rl.backends.jax import compile_cache


def test_unset_the_cache_goes_under_the_project_cache_with_a_size_bound(tmp_path):
    env = {"MLLM_RL_CACHE": str(tmp_path)}
    assert compile_cache.configure(env) == str(tmp_path / "jax-compile")
    assert env[compile_cache.DIR] == str(tmp_path / "jax-compile")
    bounded = importlib.util.find_spec("filelock") is not None  # JAX's eviction needs it
    assert env.get(compile_cache.MAX_SIZE) == (str(compile_cache.DEFAULT_MAX_BYTES) if bounded else None)


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

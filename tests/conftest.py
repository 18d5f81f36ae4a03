"""Shared fixtures: a tiny checkpoint written by the project itself, and a CLI runner."""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mllm_rl import hugepages
from tests import forkserver
from tests.junit_cpu import split_classname

ROOT = Path(__file__).resolve().parents[1]
FORKED_MODULES = ("mllm_rl.run", "mllm_rl.memplan")  # whole runs and plans: imports that cost seconds


JAX_TEST_CACHE = ROOT / ".pytest_cache" / "jax-compile"
JAX_TEST_CACHE_MAX_BYTES = 2**30  # above it at the start of a session, the cache starts empty


def _jax_compilation_cache() -> None:
    """One JAX persistent compilation cache for the suite, set before anything imports jax and
    inherited by every ``python -m mllm_rl.run`` a test starts, kept between suite runs in
    ``JAX_TEST_CACHE`` (the checkout's ``.pytest_cache``): each program the tests compile (the
    trainer's and sglang-jax's for every configuration a test runs) is compiled once per checkout,
    not once per run or per suite run. Every entry is cached (no minimum compile time or size);
    no ``JAX_COMPILATION_CACHE_MAX_SIZE`` (its eviction lists and reads the whole directory on
    every write): a cache over
    ``JAX_TEST_CACHE_MAX_BYTES`` is emptied when a session starts. A cache the caller set is kept
    as it is, with the same minimums unless the caller set them: ``JAX_COMPILATION_CACHE_DIR=$(mktemp
    -d) make test`` runs the suite cold, as on a fresh checkout."""
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return
    if (
        JAX_TEST_CACHE.is_dir()
        and sum(f.stat().st_size for f in JAX_TEST_CACHE.iterdir()) > JAX_TEST_CACHE_MAX_BYTES
    ):
        shutil.rmtree(JAX_TEST_CACHE, ignore_errors=True)
    JAX_TEST_CACHE.mkdir(parents=True, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(JAX_TEST_CACHE)


_jax_compilation_cache()
# the huge pages a run asks for when started as a program (mllm_rl/hugepages.py), set here for
# every process a test starts: a run forked by a fork server cannot start itself again
os.environ.update(hugepages.wanted(os.environ, hugepages.thp_mode(), hugepages.glibc_version()))
# the planners' measured figures likewise (mllm_rl/memplan/cache.py: keyed by the package's source
# and the frameworks' versions, so an edit measures again); a directory the caller set, or empty
# (off), is kept
os.environ.setdefault("MLLM_RL_PLAN_CACHE", str(ROOT / ".pytest_cache" / "plans"))

# XLA:CPU's LLVM optimisation level for every program the tests compile, in this process and the
# runs it starts: level 0 instead of XLA's default 3. The tests compile hundreds of small programs
# that each run for milliseconds; without LLVM's optimiser, compile-heavy test files took 18-29%
# less time. Plans and the runs they are checked against compile at the same level.
XLA_TEST_FLAGS = "--xla_backend_optimization_level=0"


def _xla_test_flags() -> None:
    """``XLA_TEST_FLAGS`` in ``XLA_FLAGS`` before anything imports jax, unless the caller chose a level."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_backend_optimization_level" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {XLA_TEST_FLAGS}".strip()


_xla_test_flags()


def without_device_count(env: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """A copy of ``env`` whose ``XLA_FLAGS`` forces no CPU device count (a child that chooses its
    own, or a process of a multi-process run), the other flags (``XLA_TEST_FLAGS``) kept."""
    out = dict(env)
    flags = [
        f
        for f in out.pop("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    if flags:
        out["XLA_FLAGS"] = " ".join(flags)
    return out


def _last_seconds(root: Path) -> dict[str, float]:
    """``{node id: seconds}`` of the tests of the last run, from the JUnit XML that
    ``scripts/run_tests.sh`` keeps (``.pytest_cache/junit-*.xml``); empty when there is none."""
    import xml.etree.ElementTree as ET

    out: dict[str, float] = {}
    for xml in (root / ".pytest_cache").glob("junit-*.xml"):
        try:
            for case in ET.parse(xml).iter("testcase"):
                split = split_classname(case.get("classname") or "")
                if split is not None:
                    out["::".join([split[0], *split[1], case.get("name", "")])] = float(case.get("time") or 0)
        except (ET.ParseError, ValueError, OSError):
            continue
    return out


def pytest_collection_modifyitems(config, items):
    """The longest test files first (each file's tests in their own order), so that the
    pytest-xdist workers (``--dist loadfile``: a file at a time) end together instead of one of
    them starting a long file last. A test's length: its seconds in the last run, else 30 s when
    it is marked slow and 0.5 s when not."""
    last = _last_seconds(Path(config.rootpath))
    per_file: dict[str, float] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        guess = 30.0 if item.get_closest_marker("slow") is not None else 0.5
        per_file[path] = per_file.get(path, 0.0) + last.get(item.nodeid, guess)
    first = {path: i for i, path in enumerate(per_file)}

    def key(item: pytest.Item) -> tuple[float, int]:
        path = item.nodeid.split("::", 1)[0]
        return -per_file[path], first[path]

    items.sort(key=key)


def cpu_seconds() -> float:
    """User + system seconds of this process, of its waited-for children and of the runs its fork
    servers forked (``forkserver.forked_cpu_seconds``)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime + forkserver.forked_cpu_seconds()


_CPU_AT_SETUP = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT_SETUP] = cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test's CPU seconds, setup to teardown (its module fixtures' with the first test that uses
    them), as the JUnit property ``cpu_s`` (``tests/junit_cpu.py`` sums them per file): on two
    cores the suite's CPU, not its wall time, is what sharing or trimming a test saves."""
    if call.when == "teardown" and _CPU_AT_SETUP in item.stash:
        item.user_properties.append(("cpu_s", round(cpu_seconds() - item.stash[_CPU_AT_SETUP], 2)))
    yield


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """Preset checkpoints go to a per-session cache, never the user's ~/.cache."""
    cache = tmp_path_factory.getbasetemp() / "mllm_rl_cache"
    monkeypatch.setenv("MLLM_RL_CACHE", str(cache))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLLM_RL_NO_PROGRESS", "1")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """A fp32 ``tiny`` checkpoint in several shards (exercises the index)."""
    from mllm_rl.checkpoint import make_checkpoint
    from mllm_rl.presets import get_preset

    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    return make_checkpoint(get_preset("tiny"), out, shard_bytes=600_000, show_progress=False)


@pytest.fixture(scope="session")
def tiny_bf16_ckpt(tmp_path_factory) -> Path:
    """The ``tiny`` preset written in bfloat16, as a pretrained checkpoint ships (mixed precision:
    float32 masters in the trainer, bf16 in the engine)."""
    from mllm_rl.checkpoint import make_checkpoint
    from mllm_rl.presets import get_preset

    out = tmp_path_factory.mktemp("ckpt-bf16") / "tiny-bf16"
    return make_checkpoint(get_preset("tiny"), out, dtype="bfloat16", show_progress=False)


def run_cli(
    module: str,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    cwd: Path = ROOT,
    fsize: int | None = None,
) -> subprocess.CompletedProcess:
    """``python -m module args`` in a subprocess of the test's interpreter (same venv); a whole run
    (``FORKED_MODULES``) is a child of the fork server of its import environment, which has the
    heavy packages imported already (``tests/forkserver.py``). ``fsize``: the child's
    ``RLIMIT_FSIZE`` soft limit in bytes."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    forked = (
        forkserver.run(module, list(args), full_env, cwd, timeout, fsize)
        if module in FORKED_MODULES
        else None
    )
    if forked is not None:
        return forked
    limit = None if fsize is None else (lambda: forkserver.limit_file_size(fsize))
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=full_env,
                          cwd=cwd, timeout=timeout, preexec_fn=limit)  # fmt: skip


def start_cli(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m module args`` started with its stdout and stderr captured (text), as
    ``run_cli`` runs it; ``communicate``, ``poll``, ``wait``, ``send_signal`` as on a Popen."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    fork = forkserver.server_for(full_env) if module in FORKED_MODULES else None
    if fork is not None:
        return fork.start(module, list(args), full_env, ROOT)
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=full_env, cwd=ROOT)  # fmt: skip


def needs_libtpu() -> None:
    """Skip unless libtpu's compiler is installed (site-packages, or the planner's compilers
    directory where ``scripts/venv.sh jax`` puts it)."""
    import importlib.util

    from mllm_rl.backends.jax.topologies import compilers_dir

    d = compilers_dir()
    if importlib.util.find_spec("libtpu") is None and not (d / "libtpu").is_dir():
        pytest.skip(f"needs libtpu (scripts/venv.sh jax installs it into {d})")

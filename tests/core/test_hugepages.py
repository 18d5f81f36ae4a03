"""When a run asks the allocators for transparent huge pages (``mllm_rl/hugepages.py``), and that
``python -m mllm_rl.bench`` really starts itself again with them (a process of its own, not a fork)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mllm_rl import hugepages
from mllm_rl.hugepages import OFF_VAR, in_effect, thp_mode, wanted
from tests.conftest import ROOT

ASK = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


@pytest.mark.parametrize(
    ("env", "mode", "glibc", "expected"),
    [
        ({}, "madvise", (2, 36), ASK),
        ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, "madvise", (2, 36),
         {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}),
        ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, "madvise", (2, 36), {}),  # the user's choice
        ({}, "madvise", (2, 34), {}),  # glibc without the tunable
        ({}, "madvise", None, {}),  # another libc
        ({}, "always", (2, 36), {}),  # the kernel gives them anyway
        ({}, "never", (2, 36), {}),
        ({}, None, (2, 36), {}),  # no THP here
        ({OFF_VAR: "0"}, "madvise", (2, 36), {}),
    ],
)  # fmt: skip
def test_what_is_asked_follows_the_thp_mode_glibc_and_the_user(env, mode, glibc, expected):
    assert wanted(env, mode, glibc) == expected


def test_the_thp_mode_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert thp_mode(f) == "always"
    assert thp_mode(tmp_path / "missing") is None


def test_in_effect_reads_the_tunable_glibc_started_with():
    assert in_effect({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"})
    assert not in_effect({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})
    assert not in_effect({})


def test_the_bench_driver_starts_itself_again_with_huge_pages():
    """``python -m mllm_rl.bench copy`` started without the tunable records that it ran with it
    (``exec``: glibc reads it only at start), unless ``MLLM_RL_HUGEPAGES=0``."""
    if "GLIBC_TUNABLES" not in wanted({}, thp_mode(), hugepages.glibc_version()):
        pytest.skip(f"this host gains nothing from it (THP mode {thp_mode()}, {hugepages.glibc_version()})")
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OFF_VAR)}
    cmd = [sys.executable, "-m", "mllm_rl.bench", "copy", "--backend", "jax", "--mb", "64", "--repeats", "1",
           "--platform", "cpu"]  # fmt: skip
    got = {}
    for off in ("1", "0"):
        r = subprocess.run(
            cmd, env={**env, OFF_VAR: off}, cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stderr[-2000:]
        got[off] = json.loads(r.stdout)["hugepages"]
    assert got == {"1": True, "0": False}

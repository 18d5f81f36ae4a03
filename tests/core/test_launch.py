"""``python -m mllm_rl.launch``: N processes with the variables both backends read, their output
prefixed, and one exit code (the first failure's) with every other process stopped."""

from __future__ import annotations

import os
import re
import time

from tests.conftest import run_cli


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_every_process_gets_its_rank_and_its_output_is_prefixed():
    r = run_cli("mllm_rl.launch", "--nproc", "3", "--module", "tests.launch_child", "--", "ok", timeout=120)
    assert r.returncode == 0, r.stderr
    lines = sorted(r.stdout.strip().splitlines())
    assert len(lines) == 3
    ports = set()
    for i, line in enumerate(lines):
        m = re.fullmatch(rf"\[p{i}\] MLLM_RL_NUM_PROCESSES=3 MLLM_RL_COORDINATOR=127\.0\.0\.1:(\d+) "
                         rf"RANK={i} WORLD_SIZE=3 MASTER_PORT=(\d+)", line)  # fmt: skip
        assert m, line
        ports.add(m.groups())
    assert len(ports) == 1  # one coordinator for all
    assert sorted(r.stderr.strip().splitlines()) == [f"[p{i}] stderr of {i}" for i in range(3)]


def test_one_failure_stops_the_others_and_is_the_exit_code(tmp_path):
    t0 = time.monotonic()
    r = run_cli("mllm_rl.launch", "--nproc", "3", "--module", "tests.launch_child", "--grace-s", "5", "--",
                "fail", "1", "5", str(tmp_path), timeout=120)  # fmt: skip
    assert r.returncode == 5, r.stderr
    assert "launch: process 1 exited 5; stopping the others" in r.stderr
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not any(alive(p) for p in pids)
    assert time.monotonic() - t0 < 60  # a liveness bound: the waiting processes were stopped, not waited for


def test_bad_input_is_one_line_and_exit_2():
    for args, msg in (
        (["--nproc", "2"], "no run arguments"),
        (["--nproc", "0", "--", "x"], "--nproc must be >= 1"),
    ):
        r = run_cli("mllm_rl.launch", *args)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_each_process_gets_its_share_of_the_cores_unless_omp_num_threads_is_set():
    """N processes on one machine, each as many OpenMP threads as there are cores, oversubscribe
    it (torch on CPU stalls in OpenMP's spinning barriers): the launcher gives each cores // N."""
    from mllm_rl.launch import threads_per_process

    cores = os.cpu_count() or 1
    assert threads_per_process(1, {}) == {"OMP_NUM_THREADS": str(cores)}
    assert threads_per_process(2, {}) == {"OMP_NUM_THREADS": str(max(1, cores // 2))}
    assert threads_per_process(4 * cores, {}) == {"OMP_NUM_THREADS": "1"}
    assert threads_per_process(2, {"OMP_NUM_THREADS": "3"}) == {}  # the user's setting stands

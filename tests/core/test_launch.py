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


def test_help_is_the_launchers_help_and_exit_0():
    r = run_cli("mllm_rl.launch", "--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("usage: python -m mllm_rl.launch --nproc N") and "--grace-s" in r.stdout


def test_a_bad_run_flag_is_one_line_before_any_process_starts(tmp_path):
    """The run's flags are checked once, by the run's own parser, before any process starts."""
    run_dir = tmp_path / "run"
    for args, line in (
        (["--backend", "torch", "--lr", "x"], "error: argument --lr: invalid float value: 'x' (see python -m mllm_rl.run --help)"),
        (["--backend", "jax", "--bogus"], "error: unrecognized arguments: --bogus (see python -m mllm_rl.run --help)"),
        (["--backend", "torch", "--plan", "swap", "--lr", "0.1"], "error: --lr 0.1: only --plan rl takes it"),
    ):  # fmt: skip
        r = run_cli("mllm_rl.launch", "--nproc", "2", "--", *args, "--run-dir", str(run_dir))
        assert r.returncode == 2 and r.stderr.splitlines() == [line] and r.stdout == "", r.stderr
    assert not run_dir.exists()


def test_processes_that_all_refuse_their_input_say_it_once(tmp_path):
    """A refusal found after start-up (the model directory), the same in every process: its line
    once, no line of the launcher's, exit 2, nothing created."""
    missing, run_dir = tmp_path / "missing", tmp_path / "run"
    r = run_cli("mllm_rl.launch", "--nproc", "2", "--", "--backend", "torch", "--model", str(missing),
                "--run-dir", str(run_dir), timeout=120)  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and re.fullmatch(r"\[p[01]\] error: .*missing.*", lines[0]), r.stderr
    assert not run_dir.exists()


def test_a_jax_run_of_n_processes_gets_the_tp_of_their_devices_unless_it_gives_one(monkeypatch, tmp_path):
    """The engine's mesh spans every process's devices, so ``--tp 1`` (the default) cannot run on
    several processes: the launcher passes N times the devices of a process."""
    from mllm_rl.launch import check_run_args

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert check_run_args(["--backend", "jax"], 2) == ["--backend", "jax", "--tp", "2"]
    assert check_run_args(["--backend", "jax", "--plan", "swap"], 3)[-2:] == ["--tp", "3"]
    assert check_run_args(["--backend", "jax", "--tp", "4"], 2) == ["--backend", "jax", "--tp", "4"]
    assert check_run_args(["--backend", "jax"], 1) == ["--backend", "jax"]
    assert check_run_args(["--backend", "torch"], 2) == ["--backend", "torch"]
    resume = ["--backend", "jax", "--resume", "--run-dir", str(tmp_path)]  # run.json's --tp stands
    assert check_run_args(resume, 2) == resume
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    assert check_run_args(["--backend", "jax"], 2)[-2:] == ["--tp", "4"]

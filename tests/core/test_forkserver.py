"""The suite's fork server runs ``python -m`` as a fresh process would (``tests/forkserver.py``):
the same exit status, stdout and stderr, the caller's environment, and a run past its timeout is
killed. Each test starts a server of its own: the suite's pooled ones (``server_for``) may be
full or taken by other environments in a worker."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import forkserver
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server is Linux only")


@pytest.fixture(scope="module")
def server():
    s = forkserver.ForkServer({**os.environ})
    yield s
    s.close()


def fresh(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    "args",
    [
        ["mllm_rl.run", "--help"],  # exit 0, usage on stdout
        ["mllm_rl.run", "--backend", "nope"],  # exit 2, one line on stderr
        ["mllm_rl.checkpoint", "make", "--preset", "no-such-preset", "--out", "x"],
    ],
)
def test_a_forked_child_exits_and_prints_as_a_fresh_process(server, args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLLM_RL_NO_PROGRESS": "1"}
    forked = server.run(args[0], args[1:], env, ROOT, timeout=120)
    want = fresh(*args, env=env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (want.returncode, want.stdout, want.stderr)


def test_the_child_gets_the_callers_environment_and_is_killed_at_its_timeout(server, tmp_path):
    code = tmp_path / "sleeper.py"
    code.write_text("import os, sys, time\nprint(os.environ['MLLM_RL_PROBE'], os.getcwd())\n"
                    "sys.stdout.flush()\ntime.sleep(float(sys.argv[1]))\nraise SystemExit(3)\n")  # fmt: skip
    env = {**os.environ, "MLLM_RL_PROBE": "seen"}
    p = server.start("sleeper", ["0"], env, tmp_path)
    assert p.wait(60) == 3 and p.communicate()[0] == f"seen {tmp_path}\n"
    with pytest.raises(subprocess.TimeoutExpired) as e:
        server.run("sleeper", ["600"], env, tmp_path, timeout=2)
    assert e.value.output == f"seen {tmp_path}\n"


def test_a_forked_childs_cpu_seconds_are_counted_once_it_ended(server, tmp_path):
    """What the suite's per-test CPU (``conftest.cpu_seconds``) adds for a forked run: its user +
    system seconds, reported by the server when the child ends."""
    (tmp_path / "spin.py").write_text(
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5:\n    pass\n"
    )
    before = forkserver.forked_cpu_seconds()
    assert server.run("spin", [], {**os.environ}, tmp_path, timeout=60).returncode == 0
    assert 0.5 <= forkserver.forked_cpu_seconds() - before < 5


def test_junit_cpu_sums_each_files_cpu_seconds(tmp_path, capsys):
    from tests import junit_cpu

    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.core.test_a" name="t1" time="2.0"><properties>'
        '<property name="cpu_s" value="1.5"/></properties></testcase>'
        '<testcase classname="tests.core.test_a.TestGroup" name="t2" time="1.0"><properties>'
        '<property name="cpu_s" value="0.25"/></properties></testcase>'
        '<testcase classname="tests.jax.test_b" name="t3" time="9.0"><properties>'
        '<property name="cpu_s" value="4.0"/></properties></testcase>'
        '<testcase classname="tests.jax.test_b" name="t4" time="0.5"/>'
        "</testsuite></testsuites>"
    )
    assert junit_cpu.per_file([xml]) == {
        "tests/core/test_a.py": (1.75, 3.0, 2),
        "tests/jax/test_b.py": (4.0, 9.5, 2),
    }
    assert junit_cpu.main([str(xml), "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[test] CPU seconds by test file: 6 in all") and len(out) == 2
    assert out[1].split()[-1] == "tests/jax/test_b.py"


def test_a_module_that_prints_when_preloaded_does_not_break_the_server(tmp_path):
    """The server's replies go to a copy of its stdout; whatever a preloaded module prints goes to
    stderr, and a forked child's stdout holds only what the child printed."""
    (tmp_path / "noisy_import.py").write_text("print('imported noisily')\n")
    (tmp_path / "hello.py").write_text("print('hello')\n")
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}",
        "MLLM_RL_TESTS_PRELOAD": "noisy_import",
        "MLLM_RL_TESTS_PRELOAD_BASE": "0",  # only the noisy module: the frameworks add seconds, not cover
    }
    s = forkserver.ForkServer(env)
    try:
        p = s.start("hello", [], env, tmp_path)
        assert p.wait(60) == 0 and p.communicate()[0] == "hello\n"
    finally:
        s.close()


def test_a_pooled_server_that_died_is_started_again(monkeypatch):
    """A server killed from outside (the OOM killer, a test) is replaced on the next run rather
    than leaving the worker's later runs to fresh processes."""
    monkeypatch.setattr(forkserver, "_servers", {})  # a pool of this test's own
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLLM_RL_TESTS_PRELOAD_BASE": "0"}  # no framework: faster
    first = forkserver.server_for(env)
    assert first is not None
    first.proc.kill()
    first.proc.wait(60)
    second = forkserver.server_for(env)
    try:
        assert second is not None and second is not first and second.proc.poll() is None
        assert forkserver.run("mllm_rl.run", ["--help"], env, ROOT, timeout=120).returncode == 0
    finally:
        if second is not None:
            second.close()


def test_variables_read_after_import_share_a_server_and_others_do_not():
    """The planner's libtpu variables, a test's NETRC and the log level ``import jax`` sets do not
    start a server of their own (a worker holds at most ``MAX_SERVERS``; past it runs are not
    forked); a variable read at import (``JAX_PLATFORMS``) does."""
    base = {"PATH": "/usr/bin", "HOME": "/root"}
    later = {**base, "TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v4-8", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
             "NETRC": "/tmp/missing", "TF_CPP_MIN_LOG_LEVEL": "1", "MLLM_RL_FAULTS": "x"}  # fmt: skip
    assert forkserver.server_key(later) == forkserver.server_key(base)
    assert forkserver.server_key({**base, "JAX_PLATFORMS": "cpu"}) != forkserver.server_key(base)

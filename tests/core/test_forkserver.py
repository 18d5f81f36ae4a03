"""The suite's fork server runs ``python -m`` as a fresh process would (``tests/forkserver.py``):
the same exit status, stdout and stderr, the caller's environment, and a run past its timeout is
killed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests import forkserver
from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the fork server is Linux only")


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
def test_a_forked_child_exits_and_prints_as_a_fresh_process(args):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MLLM_RL_NO_PROGRESS": "1"}
    forked = forkserver.run(args[0], args[1:], env, ROOT, timeout=120)
    assert forked is not None, "no fork server"
    want = fresh(*args, env=env)
    assert (forked.returncode, forked.stdout, forked.stderr) == (want.returncode, want.stdout, want.stderr)


def test_the_child_gets_the_callers_environment_and_is_killed_at_its_timeout(tmp_path):
    code = tmp_path / "sleeper.py"
    code.write_text("import os, sys, time\nprint(os.environ['MLLM_RL_PROBE'], os.getcwd())\n"
                    "sys.stdout.flush()\ntime.sleep(float(sys.argv[1]))\nraise SystemExit(3)\n")  # fmt: skip
    env = {**os.environ, "MLLM_RL_PROBE": "seen"}
    s = forkserver.server_for(env)
    assert s is not None
    p = s.start("sleeper", ["0"], env, tmp_path)
    assert p.wait(60) == 3 and p.communicate()[0] == f"seen {tmp_path}\n"
    with pytest.raises(subprocess.TimeoutExpired) as e:
        forkserver.run("sleeper", ["600"], env, tmp_path, timeout=2)
    assert e.value.output == f"seen {tmp_path}\n"


def test_a_module_that_prints_when_preloaded_does_not_break_the_server(tmp_path):
    """The server's replies go to a copy of its stdout; whatever a preloaded module prints goes to
    stderr, and a forked child's stdout holds only what the child printed."""
    (tmp_path / "noisy_import.py").write_text("print('imported noisily')\n")
    (tmp_path / "hello.py").write_text("print('hello')\n")
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}",
        "MLLM_RL_TESTS_PRELOAD": "noisy_import",
    }
    s = forkserver.ForkServer(env)
    try:
        p = s.start("hello", [], env, tmp_path)
        assert p.wait(60) == 0 and p.communicate()[0] == "hello\n"
    finally:
        s.proc.stdin.close()
        s.proc.wait(60)

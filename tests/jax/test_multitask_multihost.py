"""The lease handoffs across 2 real processes joined by ``jax.distributed`` (CPU): every handoff is a
``gather`` on the coordination service. 3 tasks over the fakes (``tests/core/multitask_fakes.py``:
the protocol alone; real multi-task runs across processes are refused until run), random delays in every phase that
differ per process, 20 repetitions in the same pair of processes, one repetition where a task
fails on process 1 only. Same lease order on both processes, every time, in bounded time."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT, without_device_count
from tests.jax.test_multihost import free_coordinator_port

pytestmark = pytest.mark.slow
REPEATS = 20
FAIL_REP = 7  # in this repetition task b fails in its train lease of step 1, on process 1 only

SCRIPT = f"""
import dataclasses, json, sys
sys.path.insert(0, {str(ROOT)!r})
from mllm_rl.backends.jax import JaxBackend, distributed
distributed.init_distributed(tp=2)  # one (fake CPU) device per process
from mllm_rl.coordination import coordinator_for
from mllm_rl.multitask.driver import Driver
from mllm_rl.multitask.driver import TaskSteps, lease_schedule
from mllm_rl.phases import PhaseRecorder
from tests.core.multitask_fakes import FakeDevice, FakeProbe, FakeTask

coord = coordinator_for(JaxBackend())
assert coord.count == 2, coord.count
steps = [TaskSteps("a", 0, 3), TaskSteps("b", 0, 2), TaskSteps("c", 0, 3)]
out = []
for rep in range({REPEATS}):
    dev = FakeDevice(max_delay_s=0.003, seed=rep * 100 + coord.index)
    rec = PhaseRecorder("mh", "fake", probe=FakeProbe(dev), process_index=coord.index,
                        sample_interval_s=0, tasks=True)
    fail = {{"b": ("train", 1)}} if rep == {FAIL_REP} and coord.index == 1 else {{}}
    tasks = {{t.name: FakeTask(t.name, dev, rec, seed=i, fail_at=fail.get(t.name))
             for i, t in enumerate(steps)}}
    drv = Driver(lease_schedule(steps), tasks, coord, device_bytes=dev.total)
    st = drv.run()
    out.append({{"ran": drv.ran, "status": {{n: dataclasses.asdict(s) for n, s in st.items()}},
                 "bytes_left": dev.total()}})
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
distributed.shutdown()
"""


def test_two_processes_agree_on_every_lease_20_times(tmp_path):
    from mllm_rl.multitask.driver import TaskSteps, lease_schedule

    port = free_coordinator_port()
    procs, logs = [], []
    for i in range(2):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu",
               "MLLM_RL_COORDINATOR": f"127.0.0.1:{port}", "MLLM_RL_NUM_PROCESSES": "2",
               "MLLM_RL_PROCESS_ID": str(i), "MLLM_RL_DIST_TIMEOUT_S": "60"}  # fmt: skip
        env = without_device_count(env)
        err = open(tmp_path / f"p{i}.err", "w+")  # noqa: SIM115 - a file, never a pipe (see test_multihost)
        logs.append(err)
        cmd = [sys.executable, "-c", SCRIPT, str(tmp_path / f"p{i}.json")]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=err, stderr=err))
    try:
        for p in procs:
            p.wait(timeout=300)  # bounded: a deadlock fails here
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for i, p in enumerate(procs):
        logs[i].seek(0)
        assert p.returncode == 0, logs[i].read()[-3000:]
    res = [json.loads((tmp_path / f"p{i}.json").read_text()) for i in range(2)]
    want = [x.key for x in lease_schedule([TaskSteps("a", 0, 3), TaskSteps("b", 0, 2), TaskSteps("c", 0, 3)])]
    assert len(res[0]) == len(res[1]) == REPEATS
    for rep, (r0, r1) in enumerate(zip(*res, strict=True)):
        assert r0["ran"] == r1["ran"], rep
        assert r0["bytes_left"] == r1["bytes_left"] == 0
        if rep != FAIL_REP:
            assert r0["ran"] == want
            assert all(s["status"] == "done" for r in (r0, r1) for s in r["status"].values())
            continue
        failed_at = next(i for i, k in enumerate(want) if k.endswith("/b/train/1"))
        assert r0["ran"] == [k for i, k in enumerate(want) if i <= failed_at or "/b/" not in k]
        for r in (r0, r1):
            b = r["status"]["b"]
            assert b["status"] == "failed" and b["error"].startswith("process 1: RuntimeError: injected")
            assert r["status"]["a"]["status"] == r["status"]["c"]["status"] == "done"

"""Multi-process JAX: 2 local CPU processes joined by ``jax.distributed`` (gloo collectives) run the
param-swap plan on ONE sglang-jax engine whose tp=2 mesh spans both processes (one CPU device each).

The shared run is started by ``python -m mllm_rl.launch --nproc 2`` (the launcher's swap test); the
fault run starts each process itself with the same environment, as each host of a cluster would.
Every engine runs in a subprocess (sglang-jax's ``shutdown()`` SIGKILLs its children, its threads
abort interpreter teardown). The processes write their output to files, not pipes: a process
blocked on a full pipe would stall the other one inside a collective.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from mllm_rl.backends.jax.distributed import DistConfig, config_from_env
from mllm_rl.phases import validate_record
from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import ROOT, without_device_count
from tests.jax.test_swap_run import PHASES

N = 2


@dataclass
class Proc:
    returncode: int
    stdout: str
    stderr: str


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_coordinator_port() -> int:
    """A free port P for the jax coordinator with P+6 and P+7 free too: sglang-jax's request
    broadcast binds ``dist_init_addr`` port+5/+6, and ours defaults to the coordinator's + 1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 7 < 65536 and _bindable(port + 6) and _bindable(port + 7):
            return port
    raise RuntimeError("no free port triple found")


def run_processes(run_dir: Path, model: Path, *extra: str, env: dict[int, dict[str, str]] | None = None,
                  timeout: float = 240) -> list[Proc]:  # fmt: skip
    """``python -m mllm_rl.run --backend jax --plan swap`` as processes 0..N-1 of one run."""
    port = free_coordinator_port()
    cmd = [sys.executable, "-m", "mllm_rl.run", "--backend", "jax", "--plan", "swap", "--model", str(model),
           "--run-dir", str(run_dir), "--max-new-tokens", "8", "--wandb", "disabled", "--quiet",
           *extra]  # fmt: skip
    logs = run_dir.parent / f"{run_dir.name}.logs"
    logs.mkdir(parents=True, exist_ok=True)
    procs, files = [], []
    for i in range(N):
        penv = {**os.environ, "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu",
                "MLLM_RL_COORDINATOR": f"127.0.0.1:{port}", "MLLM_RL_NUM_PROCESSES": str(N),
                "MLLM_RL_PROCESS_ID": str(i), "MLLM_RL_DIST_TIMEOUT_S": "120",
                **(env or {}).get(i, {})}  # fmt: skip
        penv = without_device_count(penv)
        out, err = open(logs / f"p{i}.out", "w+"), open(logs / f"p{i}.err", "w+")  # noqa: SIM115
        files.append((out, err))
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=penv, stdout=out, stderr=err, text=True))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for p, (out, err) in zip(procs, files, strict=True):
        out.seek(0)
        err.seek(0)
        results.append(Proc(p.returncode, out.read(), err.read()))
        out.close()
        err.close()
    return results


def reference(model: Path, prompt_ids: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens/logprobs of our flax nnx Qwen3 (independent of the engine), like
    ``test_swap_run.reference`` but every step right-padded to one length, so it compiles once
    instead of once per length (~2 s instead of ~30 s here); the causal mask makes this exact."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mllm_rl.backends.jax.model import load_qwen3
    from mllm_rl.checkpoint import ModelDir

    m = load_qwen3(ModelDir.open(model))
    length = max(map(len, prompt_ids)) + n
    fwd = nnx.jit(lambda m, x: jax.nn.log_softmax(m(x), axis=-1))  # [1, length, V]
    out = []
    for prompt in prompt_ids:
        ids, toks, lps = list(prompt), [], []
        for _ in range(n):
            x = np.zeros((1, length), np.int32)
            x[0, : len(ids)] = ids
            lp = np.asarray(fwd(m, jnp.asarray(x))[0, len(ids) - 1])
            tok = int(lp.argmax())
            toks.append(tok)
            lps.append(float(lp[tok]))
            ids.append(tok)
            if tok == m.config.eos_token_id:
                break
        out.append((toks, lps))
    return out


def phase_file(run_dir: Path, i: int) -> Path:
    return run_dir / ("phases.jsonl" if i == 0 else f"phases.p{i}.jsonl")


@pytest.fixture(scope="module")
def swap2(tiny_ckpt, tmp_path_factory):
    """One swap run as two processes of ``python -m mllm_rl.launch --nproc 2``, without ``--tp``."""
    run_dir = tmp_path_factory.mktemp("multihost") / "run"
    env = without_device_count()
    env.update(JAX_PLATFORMS="cpu", MLLM_RL_DIST_TIMEOUT_S="120", PYTHONUNBUFFERED="1")
    # 0.05 MiB chunks: every 2-D tensor is written into the engine's global buffer in donated slices.
    cmd = [sys.executable, "-m", "mllm_rl.launch", "--nproc", str(N), "--", "--backend", "jax", "--plan", "swap",
           "--model", str(tiny_ckpt), "--run-dir", str(run_dir), "--max-new-tokens", "8", "--swap-chunk-mb",
           "0.05", "--wandb", "disabled", "--quiet"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    return r, run_dir


@pytest.mark.slow
def test_both_processes_exit_clean(swap2):
    r, _ = swap2
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]


@pytest.mark.slow
def test_without_tp_the_launched_engine_spans_every_process(swap2):
    """``--tp 1`` (the default) cannot run on two processes (the engine's mesh spans both): without
    ``--tp`` the launcher passes 2, one CPU device per process, and the run records it; both
    processes record the same phases, each with its own process index."""
    _, run_dir = swap2
    assert json.loads((run_dir / "run.json").read_text())["options"]["tp"] == N
    p0, p1 = read_jsonl(phase_file(run_dir, 0)), read_jsonl(phase_file(run_dir, 1))
    assert [x["phase"] for x in p0] == [x["phase"] for x in p1]
    assert {x["process_index"] for x in p0} == {0} and {x["process_index"] for x in p1} == {1}
    assert "generate_result" in [x["phase"] for x in p0]


@pytest.mark.slow
def test_each_process_records_every_phase_in_its_own_file(swap2):
    _, run_dir = swap2
    assert sorted(f.name for f in run_dir.glob("phases*.jsonl")) == ["phases.jsonl", "phases.p1.jsonl"]
    for i in range(N):
        recs = read_jsonl(phase_file(run_dir, i))
        assert [r["phase"] for r in recs] == PHASES
        assert [r["idx"] for r in recs] == list(range(len(PHASES)))
        assert {r["process_index"] for r in recs} == {i}
        assert len({r["run_id"] for r in recs}) == 1
        for r in recs:
            validate_record(r)
    plan = json.loads((run_dir / "run.json").read_text())
    assert plan["process_count"] == N and plan["expected_phases"] == PHASES


@pytest.mark.slow
def test_the_engine_mesh_spans_both_processes(swap2):
    _, run_dir = swap2
    ready = [read_jsonl(phase_file(run_dir, i))[1]["info"] for i in range(N)]
    for i, info in enumerate(ready):
        assert info["process_index"] == i and info["process_count"] == N
        assert info["global_device_count"] == N and info["device_counts"] == {"cpu": 1}
    assert len({d for info in ready for d in info["devices"]}) == N  # disjoint local devices


@pytest.mark.slow
def test_memory_records_cover_each_process_own_devices(swap2):
    _, run_dir = swap2
    by_proc = []
    for i in range(N):
        recs = read_jsonl(phase_file(run_dir, i))
        local = [int(d.split(":")[-1]) for d in recs[1]["info"]["devices"]]  # jax_ready lists "cpu:<id>"
        for r in recs[1:]:
            devs = r["memory"]["devices"]
            assert [d["id"] for d in devs] == local, r["phase"]
            assert all(d["source"] == "live_arrays" and d["platform"] == "cpu" for d in devs)
        by_proc.append(recs[3]["memory"]["devices"][0]["bytes_in_use"])
    # Each process holds its own shard of every engine array (weights, KV cache): the same bytes.
    assert all(b > 0 for b in by_proc)
    assert max(by_proc) - min(by_proc) <= 4096, by_proc


@pytest.mark.slow
def test_swap_fingerprint_ok_on_every_process(swap2):
    _, run_dir = swap2
    for i in range(N):
        info = read_jsonl(phase_file(run_dir, i))[3]["info"]
        assert info["fingerprint_ok"] is True and info["tensors"] == 25, (i, info)


@pytest.mark.slow
def test_generated_tokens_equal_the_reference_on_every_process(swap2, tiny_ckpt):
    _, run_dir = swap2
    gens = [read_jsonl(phase_file(run_dir, i))[-1]["info"] for i in range(N)]
    ref = reference(tiny_ckpt, gens[0]["prompt_ids"], 8)
    for gen in gens:
        assert gen["token_ids"] == [t for t, _ in ref]
        for (_, ref_lps), lps in zip(ref, gen["logprobs"], strict=True):
            assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 1e-3


@pytest.mark.slow
def test_a_swap_that_does_nothing_on_one_process_fails_every_process(tiny_ckpt, tmp_path):
    """Fault injection on process 1 only: its shards are dropped instead of installed. The
    fingerprint is taken over the global arrays, so every process sees the mismatch."""
    procs = run_processes(tmp_path / "run", tiny_ckpt, "--tp", "2", env={1: {"MLLM_RL_FAULTS": "swap_noop"}})
    for i, p in enumerate(procs):
        assert p.returncode == 3, f"process {i}:\n{p.stderr[-3000:]}"
        assert "engine weights differ from what was sent" in p.stderr and "Traceback" not in p.stderr
        assert read_jsonl(phase_file(tmp_path / "run", i))[-1]["phase"] == "weights_swapped"


COORD = {"MLLM_RL_COORDINATOR": "127.0.0.1:12345"}


@pytest.mark.parametrize(
    "env,pattern",
    [
        (COORD, "MLLM_RL_NUM_PROCESSES is not set"),
        ({**COORD, "MLLM_RL_NUM_PROCESSES": "2"}, "MLLM_RL_PROCESS_ID is not set"),
        ({"MLLM_RL_NUM_PROCESSES": "2", "MLLM_RL_PROCESS_ID": "0"}, "MLLM_RL_COORDINATOR is not set"),
        ({"MLLM_RL_COORDINATOR": "nohost", "MLLM_RL_NUM_PROCESSES": "2", "MLLM_RL_PROCESS_ID": "0"},
         "MLLM_RL_COORDINATOR='nohost': expected host:port"),
        ({**COORD, "MLLM_RL_NUM_PROCESSES": "two", "MLLM_RL_PROCESS_ID": "0"},
         "MLLM_RL_NUM_PROCESSES='two': expected an integer"),
        ({**COORD, "MLLM_RL_NUM_PROCESSES": "2", "MLLM_RL_PROCESS_ID": "2"},
         "MLLM_RL_PROCESS_ID=2: must be < MLLM_RL_NUM_PROCESSES=2"),
    ],
)  # fmt: skip
def test_bad_distributed_env_is_one_line_exit_2(env, pattern, tiny_ckpt, tmp_path):
    r = _one_process(tmp_path / "run", tiny_ckpt, env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and pattern in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()  # rejected before anything was started


def test_tp_the_processes_cannot_split_is_one_line_exit_2(tiny_ckpt, tmp_path):
    env = {**COORD, "MLLM_RL_NUM_PROCESSES": "2", "MLLM_RL_PROCESS_ID": "0"}
    r = _one_process(tmp_path / "run", tiny_ckpt, env, "--tp", "1")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "--tp must be a multiple of 2" in r.stderr


def _one_process(run_dir: Path, model: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    ours = ("MLLM_RL_COORDINATOR", "MLLM_RL_NUM_PROCESSES", "MLLM_RL_PROCESS_ID", "JAX_COORDINATOR_ADDRESS")
    full = {k: v for k, v in os.environ.items() if k not in ours}
    cmd = [sys.executable, "-m", "mllm_rl.run", "--backend", "jax", "--plan", "swap", "--model", str(model),
           "--run-dir", str(run_dir), "--wandb", "disabled", "--quiet", *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env={**full, **env}, capture_output=True, text=True, timeout=120)


# -- environment parsing (pure, in this process: jax is not initialised) -------------------------


def test_no_env_is_one_process_without_probing_when_not_on_a_tpu():
    assert config_from_env({}, tpu_probe=lambda: None) == DistConfig("single")
    assert config_from_env({}, tpu_probe=lambda: 1).source == "single"  # a single-host TPU VM


def test_multi_host_tpu_vm_is_detected_and_left_to_jax():
    cfg = config_from_env({}, tpu_probe=lambda: 4)
    assert (cfg.source, cfg.num_processes, cfg.process_id, cfg.coordinator) == ("tpu", 4, None, None)


def test_explicit_env_wins_and_accepts_jax_coordinator_variable():
    def probe():
        raise AssertionError("the TPU probe must not run when the environment is explicit")

    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.2:8476", "MLLM_RL_NUM_PROCESSES": "4",
           "MLLM_RL_PROCESS_ID": "3"}  # fmt: skip
    assert config_from_env(env, tpu_probe=probe) == DistConfig("env", 4, 3, "10.0.0.2:8476")
    env["MLLM_RL_COORDINATOR"] = "10.0.0.9:1234"  # ours wins
    assert config_from_env(env, tpu_probe=probe).coordinator == "10.0.0.9:1234"


def test_bad_timeout_and_engine_port_name_the_variable():
    with pytest.raises(ValueError, match="MLLM_RL_DIST_TIMEOUT_S='0': must be >= 1"):
        config_from_env({"MLLM_RL_DIST_TIMEOUT_S": "0"}, tpu_probe=None)
    with pytest.raises(ValueError, match="MLLM_RL_ENGINE_PORT='x': expected an integer"):
        config_from_env({"MLLM_RL_ENGINE_PORT": "x"}, tpu_probe=None)
    with pytest.raises(ValueError, match="MLLM_RL_ENGINE_PORT=65530: must be <= 65529"):
        config_from_env({"MLLM_RL_ENGINE_PORT": "65530"}, tpu_probe=None)


class FakeCoordinationClient:
    """The key-value part of jax's coordination-service client, in memory."""

    def __init__(self, kv: dict[str, str]) -> None:
        self.kv = kv

    def key_value_set(self, key: str, value: str) -> None:
        self.kv[key] = value

    def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
        if key not in self.kv:
            raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
        return self.kv[key]


@pytest.mark.parametrize("other,error", [("cpu", None), ("tpu", "process 0: cpu, process 1: tpu")])
def test_processes_must_agree_on_the_platform(monkeypatch, other, error):
    from mllm_rl.backends.jax import distributed as dist

    kv = {"mllm_rl/platform/1": other}  # what process 1 published
    monkeypatch.setattr(dist, "_procs", dist.Procs(index=0, count=2))
    monkeypatch.setattr(dist, "_client", lambda: FakeCoordinationClient(kv))
    if error is None:
        dist.agree_on_platform("cpu")
    else:
        with pytest.raises(RuntimeError, match=f"processes came up on different platforms \\({error}\\)"):
            dist.agree_on_platform("cpu")
    assert kv["mllm_rl/platform/0"] == "cpu"

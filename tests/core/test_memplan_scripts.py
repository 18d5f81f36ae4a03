"""The plan benchmarks' command lines (the plans themselves are benchmarks, docs/PLAN.md):
``--help``, and bad arguments as one line with exit 2."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from tests.conftest import ROOT

BENCHES = ["vs-run", "targets", "startup"]


def run(*args: str) -> subprocess.CompletedProcess:
    """``python -m mllm_rl.bench ARGS``."""
    cmd = [sys.executable, "-m", "mllm_rl.bench", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", BENCHES)
def test_help(name):
    r = run("plan", name, "--help")
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout
    assert r.stdout.startswith(f"usage: python -m mllm_rl.bench plan {name} ")  # the command as typed


@pytest.mark.parametrize(
    "args",
    [
        *(["vs-run", "--backend", b, "--tolerance", "2"] for b in ("jax", "torch")),
        *(["vs-run", "--backend", b, "--steps", "0"] for b in ("jax", "torch")),
        ["vs-run", "--backend", "torch", "--margin", "0"],
        ["vs-run", "--backend", "jax", "--plan-only"],  # the torch planner's mode
        ["vs-run", "--backend", "jax", "--target", "h100"],  # jax plans the run's own cpu
        ["vs-run", "--tolerance", "0.1"],  # --backend is required
        ["targets", "--cases", "4b-v9-8"],
        ["startup", "--repeats", "0"],
        ["vs-cuda", "--micro-batch", "0"],
        [],  # WHAT is required
        ["vs-gpu"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(args):
    r = run("plan", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "error" in r.stderr.strip().splitlines()[-1]


def test_every_target_case_names_a_known_target():
    plan = importlib.import_module("mllm_rl.bench.plan")

    from mllm_rl.backends.jax.topologies import TARGETS

    for name, (args, expect) in plan.TARGET_CASES.items():
        assert args[args.index("--target") + 1] in TARGETS, name
        assert expect in ("fits", "report")


def test_plan_vs_run_plans_the_run_it_compares():
    """Each backend's defaults, and the plan command made from a run's ``run.json`` and its
    ``engine_ready_dummy`` record: JAX plans the run's own cpu at the engine's context length,
    torch its ``--target`` at ``--seq-len``."""
    bench = importlib.import_module("mllm_rl.bench.plan")

    jax = bench.parse_args(["vs-run", "--backend", "jax"])
    torch = bench.parse_args(["vs-run", "--backend", "torch", "--", "--lr", "1"])
    assert (jax.tolerance, jax.target, jax.run_args) == (0.05, "cpu", [])
    assert (torch.tolerance, torch.target, torch.seq_len) == (0.01, "h100", 32)
    assert torch.run_args == ["--save-every", "0", "--lr", "1"]
    run = {"model": "/ckpt", "group_size": 8, "prompts_per_step": 16, "schedule": "naive",
           "train": {"micro_batch_size": 64, "lora_rank": 0, "precision": "mixed", "loss": {"beta": 0.0}}}  # fmt: skip
    eng = {"context_length": 64, "max_total_tokens": 8192, "tp": 1, "max_running_requests": 128}
    records = [{"phase": "engine_ready_dummy", "step": None, "info": eng}]

    def flags(args) -> dict[str, str]:
        f = bench.plan_flags(args, run, records)
        return dict(zip(f[::2], f[1::2], strict=True))

    j, t = flags(jax), flags(torch)
    assert (j["--backend"], j["--target"], j["--seq-len"], j["--kv-tokens"]) == ("jax", "cpu", "64", "8192")
    assert (t["--backend"], t["--target"], t["--seq-len"], t["--model"]) == ("torch", "h100", "32", "/ckpt")
    assert j["--schedule"] == t["--schedule"] == "naive"
    with pytest.raises(bench.BenchError, match="engine_ready_dummy"):
        bench.plan_flags(jax, run, [])


def test_the_startup_table_names_the_machine_it_was_measured_on():
    from mllm_rl.bench.machine import machine_info
    from mllm_rl.bench.plan import startup_report

    m = machine_info()
    out = {"machine": m, "repeats": 1, "compilers": "x", "rows": [], "plain_loads_no_plugin": True}
    head = startup_report(out).splitlines()[0]
    assert head.startswith(f"MEASURED ({m['host_cpu'] or 'CPU'}, {m['cpu_count']} cores)"), head

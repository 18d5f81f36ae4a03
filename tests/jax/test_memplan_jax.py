"""The JAX memory planner: the plan command compiles the tiny model for a v4-8 (libtpu, compile
only), its numbers are checked against independent layout arithmetic; exit 6 when a phase does
not fit; one-line exit 2 for a mesh the run would refuse; and (slow) the plan for the local CPU
holds against a real run's phase records (``python -m mllm_rl.bench plan vs-run --backend jax``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mllm_rl.presets import get_preset
from tests.conftest import ROOT, needs_libtpu, run_cli

TINY = get_preset("tiny")


def plan(tmp_path: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None):
    out = tmp_path / "plan"
    r = run_cli(
        "mllm_rl.memplan",
        "--backend",
        "jax",
        "--model",
        "tiny",
        "--out",
        str(out),
        *args,
        timeout=timeout,
        env=env,
    )
    doc = json.loads((out / "plan.json").read_text()) if (out / "plan.json").exists() else None
    return r, doc


def test_a_second_plan_reads_the_figures_the_first_one_compiled(tmp_path):
    """The plan cache (``mllm_rl/memplan/cache.py``): a plan of the same request by the same code
    and compilers reads the trainer's compiled figures, the engine layout and the KV layer from it
    instead of compiling them again, and says so; an entry that does not parse is compiled again
    and replaced."""
    cache = tmp_path / "plans"
    args = ("--target", "cpu", "--kv-tokens", "256", "--micro-batch-size", "2", "--seq-len", "32")
    docs = []
    for i in range(3):
        if i == 2:  # damaged entries: compiled again
            for entry in cache.iterdir():
                entry.write_text('{"functions": 1}')
        r, doc = plan(tmp_path / str(i), *args, env={"MLLM_RL_PLAN_CACHE": str(cache)})
        assert r.returncode == 0, r.stderr[-3000:]
        docs.append(doc)
    assert sorted(e.suffix for e in cache.iterdir()) == [".json"] * 3  # trainer, engine weights, KV layer
    first, second, third = (d["plans"]["multi_stage"] for d in docs)
    seconds = [d["info"]["compile_seconds"] for d in docs]
    assert set(seconds[0]) == set(seconds[2]) == {"grad_step", "optimizer_apply"}
    assert seconds[1] == {"grad_step (cached)": 0.0, "optimizer_apply (cached)": 0.0}
    assert [any("the plan cache" in n for n in p["notes"]) for p in (first, second, third)] == [
        False,
        True,
        False,
    ]
    for p in (second, third):
        assert p["components"] == first["components"] and p["phases"] == first["phases"]
        for name, f in first["functions"].items():
            assert {**p["functions"][name], "compile_seconds": 0} == {**f, "compile_seconds": 0}, name


def tiny_engine_bytes(tp: int) -> int:
    """Engine weights on one device by hand: 2-D weights split over tp, vectors replicated (fp32)."""
    total = 0
    for shape in TINY.param_shapes().values():
        n = math.prod(shape)
        total += n // tp if len(shape) == 2 else n
    return total * 4


@pytest.mark.slow  # a whole plan, compiled by libtpu
def test_a_tpu_target_is_prepared_after_jax_was_imported():
    """A process that imported jax but started no backend (a notebook, the suite's fork server)
    plans for a TPU: the compilers directory goes on ``sys.path``, JAX stays on its CPU platform and
    libtpu gets its compile-only environment (without ``ALLOW_MULTIPLE_LIBTPU_LOAD`` two planners
    at once fought over ``/tmp/libtpu_lockfile``), as on the path that sets it up before the import."""
    needs_libtpu()
    code = ("import jax, os, sys\nfrom mllm_rl.backends.jax import topologies\n"
            "topologies.prepare(topologies.spec('v4-8'))\n"
            "print(jax.config.jax_platforms, str(topologies.compilers_dir()) in sys.path,\n"
            "      os.environ.get('ALLOW_MULTIPLE_LIBTPU_LOAD'), os.environ.get('TPU_ACCELERATOR_TYPE'))")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "ALLOW_MULTIPLE_LIBTPU_LOAD")}
    env = {k: v for k, v in env.items() if not k.startswith("TPU_")}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["cpu", "True", "1", "v4-8"]


@pytest.mark.slow  # compiles the trainer and the engine for a TPU target (an empty plan cache)
def test_tiny_plan_for_a_v4_8_compiles_with_libtpu(tmp_path):
    needs_libtpu()
    args = ("--target", "v4-8", "--tp", "2", "--kv-tokens", "4096", "--micro-batch-size", "8", "--seq-len", "64",
            "--prompts-per-step", "2", "--group-size", "4")  # fmt: skip
    r, doc = plan(tmp_path, *args, env={"MLLM_RL_PLAN_CACHE": str(tmp_path / "plans")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert doc is not None and doc["kind"] == "predicted" and list(doc["plans"]) == ["multi_stage", "naive"]
    p = doc["plans"]["multi_stage"]
    t = p["target"]
    assert (t["platform"], t["num_devices"], t["num_hosts"], t["device_kind"]) == ("tpu", 4, 1, "TPU v4")
    assert t["hbm_bytes"] == int(30.75 * 2**30) and "libtpu" in t["source"]
    comps = p["components"]
    assert comps["engine_weights"]["bytes_per_device"] == tiny_engine_bytes(2)
    cell = TINY.num_hidden_layers * (TINY.num_key_value_heads // 2) * 128 * 2 * 4
    assert comps["kv_pool"]["bytes_per_device"] == (4096 + 1) * cell
    # 2 prompts x 4 completions decode in the 8 bucket: [128, V] + 2 x [8, V] float32
    assert comps["engine_logits"]["bytes_per_device"] == (128 + 2 * 8) * TINY.vocab_size * 4
    # AdamW keeps two moments per trainable param: about twice the params, sharded alike
    assert 1.9 < comps["optimizer"]["bytes_per_device"] / comps["trainer_params"]["bytes_per_device"] < 2.2
    fns = p["functions"]
    assert set(fns) == {"grad_step", "optimizer_apply", "engine_step"}
    # the engine's forward compiled by libtpu: its prefill of the 8 sequences x 64 tokens and its
    # decode of the 8 bucket, with native attention; the row is the one that adds more
    step = fns["engine_step"]
    assert step["method"] == "compiler" and step["extra_bytes"] > 0 and not step["rejected"]
    assert "attention 'native'" in step["detail"] and "512 tokens" in step["detail"], step["detail"]
    assert step["argument_bytes"] > comps["kv_pool"]["bytes_per_device"]  # the pool is its argument
    seconds = doc["info"]["compile_seconds"]
    assert seconds["engine_extend"] > 0 and seconds["engine_decode"] > 0
    forward = doc["info"]["engine_forward"]  # both programs, the row the one that adds more
    assert set(forward) == {"extend", "decode"} and "decode batch 8, 8 tokens" in forward["decode"]["shape"]
    assert step["extra_bytes"] == max(f["extra_bytes"] for f in forward.values())
    assert f"decode {forward['decode']['extra_bytes']} B extra" in step["detail"]
    grad = fns["grad_step"]
    assert (
        grad["peak_bytes"] > grad["argument_bytes"] > 0
        and grad["compile_seconds"] > 0
        and not grad["rejected"]
    )
    phases = {ph["phase"]: ph for ph in p["phases"]}
    assert phases["rollout"]["function"] == "engine_step"
    assert phases["rollout"]["total"] == sum(phases["rollout"]["resident"].values()) + step["extra_bytes"]
    assert phases["train_step"]["function"] == "grad_step"
    assert (
        phases["train_step"]["total"] == sum(phases["train_step"]["resident"].values()) + grad["extra_bytes"]
    )
    assert doc["plans"]["naive"]["phases"][-4]["phase"] == "update_weights"
    assert "kv_pool" in doc["plans"]["naive"]["phases"][-4]["resident"]
    assert p["fits"] and "multi_stage: fits" in r.stdout and "host peak RSS" in r.stdout
    assert "engine attention: sglang-jax 'native' on TPU v4" in r.stdout  # its fa kernel refuses v4
    assert (tmp_path / "plan" / "plan.txt").read_text() == r.stdout
    # the same plan again: every compiled figure read from the plan cache, none compiled
    r, again = plan(tmp_path / "again", *args, env={"MLLM_RL_PLAN_CACHE": str(tmp_path / "plans")})
    assert r.returncode == 0, r.stderr[-3000:]
    assert again["info"]["compile_seconds"] == {f"{k} (cached)": 0.0 for k in seconds}
    assert again["info"]["engine_forward"] == forward
    p2 = again["plans"]["multi_stage"]
    assert p2["components"] == comps and p2["phases"] == p["phases"]
    assert {k: {**f, "compile_seconds": 0} for k, f in p2["functions"].items()} == {
        k: {**f, "compile_seconds": 0} for k, f in fns.items()
    }
    assert "<table>" in (tmp_path / "plan" / "plan.html").read_text()


@pytest.mark.slow  # a whole plan, compiled by libtpu
def test_the_optimizer_in_host_memory_is_planned_on_the_host_and_streamed(tmp_path):
    """``--model-option optimizer_memory=host`` on a v4-8 (the TPU model path, a bf16 checkpoint's
    float32 masters and moments): the AdamW state is in every phase's host copies from the
    trainer's start on and in no device row; the update is one leaf's, its moments counted in its
    extra bytes; the host-memory verdict uses ``--host-ram-gib``."""
    needs_libtpu()
    r, doc = plan(tmp_path, "--model", "qwen3-0.6b", "--target", "v4-8", "--tp", "2", "--kv-tokens", "4096",
                  "--micro-batch-size", "4", "--seq-len", "64", "--model-option", "optimizer_memory=host",
                  "--host-ram-gib", "2", "--engine-forward", "estimate")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    p = doc["plans"]["multi_stage"]
    opt = p["components"]["optimizer"]
    assert opt["memory"] == "host" and opt["bytes_per_device"] > 0
    assert all("optimizer" not in ph["resident"] for ph in p["phases"])
    started = False
    for ph in p["phases"]:
        started = started or ph["phase"] == "setup:trainer_init"
        assert (ph["host"].get("optimizer") == 4 * opt["bytes_per_device"]) == started, ph["phase"]
    apply = p["functions"]["optimizer_apply"]
    assert "streamed from the host" in apply["detail"]
    assert (
        apply["extra_bytes"] >= apply["argument_bytes"] > 0
    )  # mu and nu: the size of the param and its gradient
    assert apply["peak_bytes"] < opt["bytes_per_device"]  # never the whole state on the device
    host = p["host"]
    assert host["ram_bytes"] == 2 * 2**30 and host["fits"] is False  # 0.6B's offloaded state > 2 GiB
    assert "host (host copies, per host): peak" in r.stdout and "OVER" in r.stdout.split("host (")[1]


@pytest.mark.slow  # a whole plan, compiled by libtpu
def test_a_phase_that_does_not_fit_exits_6_naming_phase_and_component(tmp_path):
    # the local CPU target (host RAM): a 10-million-token KV pool of the tiny model is 38 GiB
    r, doc = plan(
        tmp_path, "--target", "cpu", "--kv-tokens", "10000000", "--micro-batch-size", "4", "--seq-len", "32"
    )
    assert r.returncode == 6, r.stderr[-3000:]
    assert "DOES NOT FIT: kv_pool overflows in setup:release_rollout" in r.stdout
    assert doc["plans"]["multi_stage"]["first_overflow"] == ["setup:release_rollout", "kv_pool"]
    # on CPU the engine's step is estimated from the shapes: one layer's float32 activations for a
    # 2048-token prefill chunk (64 sequences x 32 tokens) + 3 float32 [64, V] sampler arrays
    c = TINY
    per_token = 4 * c.hidden_size + (2 * c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    per_token += 3 * c.intermediate_size
    step = doc["plans"]["multi_stage"]["functions"]["engine_step"]
    assert step["method"] == "estimate" and step["argument_bytes"] == 0
    assert step["peak_bytes"] == 2048 * per_token * 4 + 3 * 64 * c.vocab_size * 4


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--target", "v4-8", "--tp", "4"], "2 kv heads of tiny are not divisible"),
        (["--target", "v4-16", "--tp", "2"], "on 2 hosts the engine's mesh spans every device; pass --tp 8"),
        (["--target", "v4-8", "--trainer-tp", "3"], "--trainer-tp 3 does not divide the 4 devices"),
        (["--target", "cpu", "--model-option", "warp_speed=9"], "--model-option warp_speed: unknown"),
        (
            ["--target", "cpu", "--engine", "embedded"],
            "--engine 'embedded': the JAX backend's engine is sglang-jax",
        ),
    ],
)
def test_a_mesh_the_run_would_refuse_is_one_line_exit_2(tmp_path, args, msg):
    """Refused from the flags alone, before any progress line or compiler output (no libtpu
    needed): stderr is the one error line, stdout is empty."""
    r, _ = plan(tmp_path, *args)
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-2000:])
    (line,) = r.stderr.splitlines()
    assert line.startswith("error:") and msg in line, line
    assert r.stdout == ""


@pytest.mark.parametrize(
    "args",
    [["--target", "v4-8", "--tp", "3"], ["--target", "v5e-8", "--fsdp", "3"], ["--model-option", "remat=x"]],
)
def test_a_refused_plan_loads_no_compiler(args):
    """A refusal the flags decide comes before jax (and libtpu's or XLA's start-up lines) is loaded."""
    code = (
        "import sys; from mllm_rl.memplan.__main__ import main; "
        f"rc = main(['--backend', 'jax', '--model', 'tiny', *{args!r}]); "
        "print(rc, sorted(m for m in ('jax', 'jaxlib', 'torch') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.stdout.strip() == "2 []", (r.stdout, r.stderr)
    (line,) = r.stderr.splitlines()
    assert line.startswith("error: --"), line


@pytest.mark.slow  # a whole plan, compiled by libtpu
def test_fit_reports_a_model_that_does_not_fit_at_micro_batch_1(tmp_path):
    r, _ = plan(
        tmp_path,
        "--target",
        "cpu",
        "--fit",
        "--margin",
        "0.00001",
        "--seq-len",
        "32",
        "--micro-batch-size",
        "1",
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "[fit] micro_batch=1: does not fit" in r.stderr
    assert "does not fit cpu even at micro_batch=1" in r.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_cpu_plan_holds_against_a_tiny_run(tmp_path):
    """The acceptance check: a real 2-step tiny run on CPU, then the plan for the local CPU with
    the run's knobs: components and the bytes at the end of every phase within 5%."""
    out = tmp_path / "cmp.json"
    r = run_bench("plan", "vs-run", "--backend", "jax", "--model", "tiny", "--steps", "2", "--run-dir",
                  str(tmp_path / "run"), "--json", str(out))  # fmt: skip
    res = json.loads(out.read_text()) if out.exists() else {}
    off = [x for x in res.get("components", []) + res.get("phases", []) if not x["within"]]
    assert r.returncode == 0 and res["within"], off or r.stderr[-3000:]  # which phase or component is off
    comps = {c["component"]: c for c in res["components"]}
    assert set(comps) == {"engine_weights", "kv_pool", "trainer_params", "optimizer"}
    assert all(abs(c["ratio"] - 1) <= 0.05 for c in comps.values())
    names = [p["phase"] for p in res["phases"]]
    assert "train_step" in names and "setup:trainer_init" in names and "resume_kv" in names
    assert res["grad_step"]["temp_bytes"] > 0 and len(res["grad_step"]["measured_rss_rise"]) == 2


def run_bench(name: str, *args: str):
    """``python -m mllm_rl.bench NAME ARGS``."""
    import subprocess

    return subprocess.run([sys.executable, "-m", "mllm_rl.bench", name, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900)  # fmt: skip


@pytest.mark.slow  # a whole plan, compiled by libtpu
def test_fit_finds_the_micro_batch_then_fills_the_kv_pool(tmp_path):
    r, doc = plan(tmp_path, "--target", "cpu", "--fit", "--micro-batch-size", "4", "--fit-max", "8",
                  "--seq-len", "32", "--margin", "0.008")  # fmt: skip  # of half the available RAM
    assert r.returncode == 0, r.stderr[-2000:]
    assert "[fit] micro_batch=4: fits" in r.stderr and "[fit] micro_batch=8: fits" in r.stderr
    assert doc["fit"]["value"] == 8 and [p["value"] for p in doc["fit"]["probes"]] == [4, 8]
    p = doc["plans"]["multi_stage"]
    tokens = doc["kv_fit"]["tokens"]
    cell = TINY.num_hidden_layers * TINY.num_key_value_heads * 128 * 2 * 4
    assert p["components"]["kv_pool"]["bytes_per_device"] == (tokens + 1) * cell
    assert p["inputs"]["micro_batch"] == 8 and p["inputs"]["kv_tokens"] == tokens
    # the pool fills the tightest phase to the budget: one more token would not fit
    tight = next(ph for ph in p["phases"] if ph["phase"] == doc["kv_fit"]["tightest_phase"])
    assert tight["total"] <= p["budget_bytes"] < tight["total"] + cell


@pytest.mark.slow  # a whole plan, compiled by libtpu
def test_a_function_libtpu_rejects_is_shown_rejected_and_exits_6(tmp_path):
    """libtpu refuses at compile time a program one device cannot hold: dense attention scores of
    64 x 16384 positions are ~166 GiB per v4 device."""
    needs_libtpu()
    r, doc = plan(tmp_path, "--target", "v4-8", "--tp", "2", "--kv-tokens", "1024", "--micro-batch-size", "64",
                  "--seq-len", "16384", "--model-option", "attention=dense", "--engine-forward", "estimate")  # fmt: skip
    assert r.returncode == 6, r.stderr[-2000:]
    grad = doc["plans"]["multi_stage"]["functions"]["grad_step"]
    assert "RESOURCE_EXHAUSTED" in grad["rejected"] and grad["peak_bytes"] > 30.75 * 2**30
    assert doc["plans"]["multi_stage"]["first_overflow"] == ["train_step", "temp:grad_step"]
    assert "REJECTED: RESOURCE_EXHAUSTED" in r.stdout


@pytest.mark.slow  # compiled by libtpu
def test_a_micro_batch_smaller_than_the_data_axis_is_planned_padded(tmp_path):
    """Micro-batch 3 on a v4-8 (data axis 4): the trainer pads it to 4 rows so that each device
    computes one, and the plan compiles those 4 rows and says so."""
    needs_libtpu()
    r, doc = plan(tmp_path, "--target", "v4-8", "--tp", "2", "--kv-tokens", "1024", "--micro-batch-size", "3",
                  "--seq-len", "64", "--engine-forward", "estimate")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "micro-batch 3 is padded to 4 rows, a multiple of the trainer's data axis (fsdp 4)" in r.stdout
    assert doc["plans"]["multi_stage"]["functions"]["engine_step"]["method"] == "estimate"  # --engine-forward
    assert doc["plans"]["multi_stage"]["functions"]["grad_step"]["detail"].startswith(
        "micro-batch 4 x 64 tokens (3 padded)"
    )


def test_data_rows_are_a_multiple_of_the_data_axis():
    from jax.sharding import AbstractMesh

    from mllm_rl.backends.jax.sharding import data_rows

    mesh = AbstractMesh((4, 2), ("fsdp", "tp"))
    assert [data_rows(mesh, r) for r in (1, 3, 4, 5, 64)] == [4, 4, 4, 8, 64]
    assert data_rows(AbstractMesh((1, 8), ("fsdp", "tp")), 3) == 3


def test_each_compiled_function_gets_a_progress_line_on_a_terminal(monkeypatch, capsys):
    """A plan compiles for minutes on a CPU host (an engine prefill for a TPU target): on a
    terminal a line names the function being compiled and the target."""
    import jax
    import jax.numpy as jnp

    from mllm_rl import progress
    from mllm_rl.backends.jax import memplan
    from mllm_rl.memplan.compose import Target

    monkeypatch.setattr(progress, "progress_enabled", lambda: True)
    info: dict = {"compile_seconds": {}}
    cpu = Target("cpu", "cpu", 1, 1, 1 << 30, "cpu", "test")
    lowered = lambda: jax.jit(lambda x: x * 2).lower(jnp.ones(4))  # noqa: E731
    c = memplan._compile_lowered("grad_step", lowered, cpu, info, "x*2")
    assert "memory plan: compiling grad_step for cpu" in capsys.readouterr().err
    assert c.memory.argument_bytes == 16 and "grad_step" in info["compile_seconds"]


def test_only_compiled_figures_are_stored(tmp_path, monkeypatch):
    """An estimate standing in for a compile that failed (perhaps for a passing reason) is not kept:
    the next plan compiles again; compiled figures are kept and read back as "(cached)"."""
    from mllm_rl.backends.jax import memplan
    from mllm_rl.memplan.compose import FunctionMemory

    monkeypatch.setenv("MLLM_RL_PLAN_CACHE", str(tmp_path))
    calls = []

    def compile_(method: str):
        def run(info: dict, notes: list) -> tuple[dict, dict]:
            calls.append(method)
            info["compile_seconds"]["engine_decode"] = 1.5
            notes.append(f"{method} note")
            return {"engine_step": FunctionMemory("engine_step", 10, 4, method=method)}, {}

        return run

    for method, expect_calls in (("estimate", 2), ("compiler", 3)):
        for _ in range(2):
            info, notes = {"compile_seconds": {}}, []
            fns, _ = memplan._compiled_stored(f"x {method}", {"n": 1}, compile_(method), info, notes)
            assert fns["engine_step"].peak_bytes == 10 and f"{method} note" in notes
        assert len(calls) == expect_calls
    assert info["compile_seconds"] == {"engine_decode (cached)": 0.0} and "the plan cache" in notes[-1]
    assert len(list(tmp_path.iterdir())) == 1

"""Cheap checks of the benchmarks (no benchmark runs here: those are in docs/BENCHMARKS.md).

The driver (``python -m mllm_rl.bench``: the list without importing a framework, one line for an
unknown name), ``--help`` of every benchmark, argument validation (one-line error, exit 2),
``gpu_bench_all.sh`` (--list / --dry-run / shellcheck), the shared helpers of ``mllm_rl.bench`` (no
framework at import, the copy baseline), and the pure parts: the RL-memory analysis and KV-fit
prediction on synthetic phase records, the soak's RSS slope, the summary table.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mllm_rl.bench.__main__ import BENCHES
from tests.conftest import ROOT

SCRIPTS = ROOT / "scripts"
HELP_BENCHES = ["swap", "release", "rl-memory", "engine", "soak", "summary", "step-cost", "precision",
                "plan vs-cuda", "processes"]  # fmt: skip
# Every benchmark and script imports the shared helpers from the package (never through sys.path).
PACKAGE_USERS = sorted(p.relative_to(ROOT).as_posix()
                       for p in [*(ROOT / "mllm_rl" / "bench").glob("*.py"), *SCRIPTS.glob("*.py")])  # fmt: skip
BENCH_MODULES = ["mllm_rl.bench", "mllm_rl.bench.machine", "mllm_rl.bench.child", "mllm_rl.bench.records",
                 "mllm_rl.bench.cli", "mllm_rl.bench.tables", "mllm_rl.bench.copy_bandwidth",
                 "mllm_rl.bench.step_cost"]  # fmt: skip


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m mllm_rl.bench ARGS``."""
    return run(sys.executable, "-m", "mllm_rl.bench", *args, timeout=timeout)


# -- the driver --------------------------------------------------------------------------------------
def test_driver_lists_every_benchmark_without_importing_a_framework():
    r = run(sys.executable, "-X", "importtime", "-m", "mllm_rl.bench", "--help")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("usage: python -m mllm_rl.bench NAME")
    listed = dict(line.strip().split(None, 1) for line in lines if line.startswith("  "))
    assert list(listed) == list(BENCHES)
    assert all(d.strip() and d != "(not found)" for d in listed.values()), listed
    imported = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in r.stderr.splitlines()
        if line.startswith("import time:")
    }
    assert "mllm_rl" in imported and not imported & {"jax", "torch", "flax", "numpy"}, sorted(imported)
    assert bench().stdout == bench("-h").stdout == r.stdout  # no name, -h and --help: the same list


def test_driver_names_every_benchmark_module():
    """Each name is a module with a ``main``; each module of the package with a ``main`` has a name."""
    for name, module in BENCHES.items():
        assert name == module.rsplit(".", 1)[1].replace("_", "-") or (name, module) == (
            "copy",
            "mllm_rl.bench.copy_bandwidth",
        )
        assert importlib.util.find_spec(module) is not None, module
    mains = {f"mllm_rl.bench.{p.stem}" for p in (ROOT / "mllm_rl" / "bench").glob("*.py")
             if p.stem != "__main__" and "\ndef main(" in p.read_text()}  # fmt: skip
    assert mains == set(BENCHES.values())


def test_driver_refuses_an_unknown_name_in_one_line():
    r = bench("swapp", "--preset", "tiny")
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert "'swapp'" in line and "swap" in line.replace("'swapp'", "") and "torch-attention" in line


def test_bench_modules_import_no_framework():
    """Every benchmark imports jax / torch where it uses them, not at import."""
    code = f"import sys, json; import {', '.join(BENCHES.values())}; " + (
        "print(json.dumps([m for m in ('jax', 'torch', 'flax') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


# -- every benchmark -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", HELP_BENCHES)
def test_help(name):
    r = bench(*name.split(), "--help")
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout
    assert r.stdout.startswith(f"usage: python -m mllm_rl.bench {name} ")  # the command as typed


@pytest.mark.parametrize(
    "args",
    [
        ["swap", "--modes", "fast"],
        ["swap", "--tp", "0"],
        ["release", "--cycles", "0"],
        ["rl-memory", "--budget-gb", "-1"],
        ["rl-memory", "--schedules", "eager"],
        ["engine", "--batch", "0,4"],
        ["engine", "--engines", "vllm"],
        ["engine", "--new-tokens", "1"],
        ["soak"],  # --backend is required
        ["soak", "--backend", "torch", "--warmup", "-1"],
        ["copy", "--backend", "jax", "--mb", "0"],
        ["copy", "--backend", "mxnet"],
    ],
)
def test_bad_arguments_exit_2_with_one_line(args):
    r = bench(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "error" in r.stderr.strip().splitlines()[-1]


def test_bad_preset_is_one_line_error(tmp_path):
    r = bench("rl-memory", "--preset", str(tmp_path / "missing"))
    assert r.returncode == 2
    assert r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1


def test_gpu_bench_all_lists_and_dry_runs(tmp_path):
    sh = str(SCRIPTS / "gpu_bench_all.sh")
    gpu = run("bash", sh, "--list").stdout.split()
    cpu = run("bash", sh, "--cpu", "--list").stdout.split()
    for prefix in ("swap-", "release-", "rl-", "soak-", "engine-"):
        assert any(s.startswith(prefix) for s in gpu) and any(s.startswith(prefix) for s in cpu)
    assert "swap-torch-qwen3-4b" in gpu and "swap-jax-qwen3-4b" in gpu and "soak-jax-tiny" in cpu
    r = run("bash", sh, "--dry-run", "--only", "swap,rl-torch", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stdout.splitlines() if not x.startswith("#")]
    assert len(lines) == 4 and all("--json" in x for x in lines)
    assert "--platform cuda" in r.stdout and "--bisect" in r.stdout
    assert not (tmp_path / "o").exists()  # a dry run writes nothing
    bad = run("bash", sh, "--install", "conda")
    assert bad.returncode == 2 and bad.stderr.startswith("error:")


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_the_shell_scripts_are_shellcheck_clean():
    """``gpu_bench_all.sh`` and the device scripts (the check, its wheels, the fault probe): the
    device ones run only where a GPU is lent, so this is what keeps them from rotting here."""
    r = run("shellcheck", *map(str, sorted([*SCRIPTS.glob("*.sh"), *(SCRIPTS / "device").glob("*.sh")])))
    assert r.returncode == 0, r.stdout


def _rec(phase: str, step: int | None, start: int, end: int, peak: int, kv_released: bool | None,
         info: dict | None = None) -> dict:  # fmt: skip
    inf = dict(info or {})
    if kv_released is not None:
        inf["engine"] = {"released": ["kv_cache"] if kv_released else []}
    dev = {"id": 0, "platform": "cpu", "bytes_in_use": end, "bytes_in_use_start": start, "phase_peak_bytes": peak,
           "bytes_limit": None, "source": "live_arrays"}  # fmt: skip
    return {"phase": phase, "step": step, "memory": {"devices": [dev], "host": {}}, "info": inf}


def _records(naive: bool) -> list[dict]:
    kv, w, t = 100, 10, 30  # KV cache, engine weights, trainer (params + optimizer)
    recs = [_rec("jax_ready", None, 0, 0, 0, None),
            _rec("engine_ready_dummy", None, 0, kv + w, kv + w, None, {"max_total_tokens": 50}),
            _rec("trainer_init", None, kv + w, kv + w + t, kv + w + t, None),
            _rec("offload_trainer", None, kv + w + t, kv + w, kv + w + t, False),
            # a setup phase with a step phase's name and a peak above every step: must stay apart
            _rec("release_rollout", None, kv + w, 0, kv + w + 7, True)]  # fmt: skip
    for step in range(2):
        recs += [_rec("rollout", step, kv + w, kv + w, kv + w + 5, False),
                 _rec("release_rollout", step, kv + w, 0, kv + w, True, {"held": {"kv_cache": kv, "weights": w}}),
                 _rec("train_step", step, t, t, t + 20, True)]  # fmt: skip
        if naive:
            recs += [_rec("resume_rollout", step, t, t + kv + w, t + kv + w, False),
                     _rec("offload_trainer_params", step, t + kv + w, kv + w, t + kv + w, False)]  # fmt: skip
        else:
            recs += [_rec("update_weights", step, t + w, t + w, t + w, True),
                     _rec("offload_trainer_params", step, t + w, w, t + w, True),
                     _rec("resume_kv", step, w, kv + w, kv + w, False)]  # fmt: skip
    return recs


def test_rl_memory_analysis_and_kv_fit():
    b = importlib.import_module("mllm_rl.bench.rl_memory")

    ms, nv = b.analyse(_records(naive=False)), b.analyse(_records(naive=True))
    assert ms["kv_bytes"] == 100 and ms["kv_bytes_per_token"] == 2.0
    assert ms["step_peak"] == 115 and ms["step_peak_phase"] == "rollout"
    assert nv["step_peak"] == 140 and nv["step_peak_phase"] == "resume_rollout"
    assert ms["setup_peak"] == 140  # engine + KV + trainer during setup
    phases = {p["phase"]: p for p in ms["phases"]}
    assert phases["release_rollout"]["kv"] and not phases["train_step"]["kv"] and phases["resume_kv"]["kv"]
    # budget 200: steps only -> multi_stage KV <= 200 - 15 (rollout's non-KV) = 185 bytes = 92 tokens
    fit = b.predict_kv(ms, 200, steps_only=True)
    assert fit == {"kv_bytes": 185, "tokens": 92, "limiting_phase": "rollout"}
    assert b.predict_kv(nv, 200, steps_only=True)["kv_bytes"] == 160  # resume_rollout: trainer + weights
    # whole run: the setup's trainer_init holds KV + weights + trainer (non-KV 40) -> 160 bytes, 80 tokens
    fit_run = b.predict_kv(ms, 200, steps_only=False)
    assert fit_run == {"kv_bytes": 160, "tokens": 80, "limiting_phase": "setup:trainer_init"}
    assert phases["setup:release_rollout"]["peak"] == 117 and phases["release_rollout"]["peak"] == 110
    assert phases["release_rollout"]["n"] == 2 and phases["setup:release_rollout"]["n"] == 1
    assert b.predict_kv(ms, 40, steps_only=True)["tokens"] == 0  # train_step alone (50) does not fit


def test_soak_slope():
    soak = importlib.import_module("mllm_rl.bench.soak")

    assert soak._slope([5, 5, 5, 5]) == 0
    assert soak._slope([0, 10, 20, 30]) == pytest.approx(10)
    assert soak._slope([7]) is None


def test_summary_table(tmp_path):
    bench_summary = importlib.import_module("mllm_rl.bench.summary")

    (tmp_path / "soak-x.json").write_text(json.dumps({
        "bench": "soak", "backend": "torch", "preset": "tiny", "platform": "cpu", "cycles": 3, "engine": "E",
        "trainer": False, "weights_cpu_backup": False, "device_max_abs_dev_bytes": [0], "rss_max_abs_dev_bytes": 0,
        "token_mismatch_cycles": [], "targets": {"t": {"pass": True}, "u": {"pass": None}}}))  # fmt: skip
    case = {"rows": 4, "seq_len": 4096, "precision": "mixed", "lora_rank": 0, "options": [["remat", True]]}
    (tmp_path / "plan-z.json").write_text(json.dumps({
        "bench": "plan_vs_cuda", "backend": "torch", "preset": "qwen3-4b", "platform": "cuda",
        "predicted": {"case": case, "peak_bytes": 2**31}, "peak_over_plan": 1.005, "targets": {},
        "measured": {"peak_bytes": int(2**31 * 1.005), "oom": False, "tokens_per_s": 9000.0}}))  # fmt: skip
    (tmp_path / "status.tsv").write_text("soak-x\t0\t5\nswap-y\t1\t9\n")
    text = bench_summary.summarize(Path(tmp_path))
    assert "| plan-z | plan_vs_cuda | torch | qwen3-4b | cuda |" in text
    assert (
        "4 x 4096 mixed, lora 0, remat=True: peak 2.01 GiB measured / 2.00 predicted = 1.0050, 9000 tokens/s"
        in text
    ), text
    assert "| soak-x | soak | torch | tiny | cpu |" in text and "t pass, u n/a" in text
    assert "swap-y" in text and "FAIL" in text


def test_first_touch_times_a_fill_right_after_a_free_and_after_an_idle_pause(tmp_path):
    out = tmp_path / "out.json"
    r = bench("first-touch", "--mb", "16", "--idle", "0.2", "--repeats", "2", "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last == json.loads(out.read_text()) and last["bytes"] == 16 * 2**20 and last["idle_s"] == 0.2
    assert set(last["median_s"]) == {"right after a free", "after 0.2 s idle"}
    assert all(v > 0 for v in last["median_s"].values()) and last["idle_over_warm"] > 0
    from mllm_rl.bench.machine import REPORTING, machine_info

    reporting = REPORTING.exists()
    assert (last["reported_kib"] is not None) == reporting and (last["reported_kib"] or 0) >= 0
    assert machine_info()["free_page_reporting"] == reporting  # every bench JSON says so
    assert "GB/s" in r.stdout


# -- the shared helpers (mllm_rl.bench) --------------------------------------------------------
def test_bench_package_imports_no_framework():
    code = f"import sys, json; import {', '.join(BENCH_MODULES)}; " + (
        "print(json.dumps([m for m in ('jax', 'torch', 'flax') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


@pytest.mark.parametrize("path", PACKAGE_USERS)
def test_scripts_import_the_helpers_from_the_package(path):
    text = (ROOT / path).read_text()
    assert "bench_common" not in text
    # plan startup puts the compilers directory on sys.path in its child, on purpose
    assert "sys.path.insert(0, str(" not in text


def test_copy_baseline_from_the_package():
    r = bench("copy", "--backend", "jax", "--platform", "cpu", "--mb", "1", "--repeats", "2")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["runtime"] == "jax" and out["platform"] == "cpu" and out["bytes"] == 2**20
    for k in ("h2d", "d2h", "d2d"):
        assert out[k]["gbps_best"] > 0 and out[k]["seconds_best"] <= out[k]["seconds_median"]


def test_failed_targets_turn_success_into_exit_1_only_when_strict():
    from mllm_rl.bench.cli import exit_code, target

    ok = {"targets": {"a": target(1.0, "<=", 1.05), "gpu": target(None, "<=", 1.0, applies=False, why="cpu")}}
    bad = {"targets": {"a": target(1.2, "<=", 1.05)}}
    assert exit_code(0, ok) == 0 and exit_code(0, bad) == 1 and exit_code(0, bad, strict=False) == 0
    assert exit_code(2, None) == 2 and exit_code(1, None) == 1


def test_main_with_child_fails_a_target_only_when_strict(capsys):
    from types import SimpleNamespace

    from mllm_rl.bench.cli import main_with_child, target

    def bench(args):
        return {"targets": {"a": target(1.2, "<=", 1.05)}}

    args = SimpleNamespace(child=False, json=None)
    assert main_with_child(args, dict, bench, lambda o: "", lambda o: {}, strict=True) == 1
    assert main_with_child(args, dict, bench, lambda o: "", lambda o: {}) == 0
    # a check of the results of its own (``plan startup``/``targets``): no child, no --child flag
    plain = SimpleNamespace(json=None)
    assert main_with_child(plain, None, bench, str, dict, strict=lambda o: "targets" in o) == 1
    assert main_with_child(plain, None, bench, str, dict, strict=lambda o: False) == 0
    child = main_with_child(SimpleNamespace(child=True), lambda a: {"x": 1}, bench, str, dict, strict=True)
    assert child == 0 and capsys.readouterr().out.strip().splitlines()[-1] == '{"x": 1}'


def test_bench_children_run_without_the_jax_compilation_cache_unless_it_is_set(monkeypatch):
    """A run turns JAX's persistent compilation cache and the planners' cache on by default; a bench
    child gets both off, so its compile, plan and step-0 figures do not depend on earlier runs,
    unless the caller set a cache."""
    from mllm_rl.bench.child import child_env

    for var in ("JAX_COMPILATION_CACHE_DIR", "MLLM_RL_PLAN_CACHE"):
        monkeypatch.delenv(var, raising=False)
        env = child_env({"X": "1"})
        assert env[var] == "" and env["X"] == "1" and env["MLLM_RL_NO_PROGRESS"] == "1"
        monkeypatch.setenv(var, "/mine")
        assert child_env()[var] == "/mine"


def test_a_failed_childs_error_is_not_buried_under_the_cuda_clients_unload_lines(tmp_path):
    """After a CUDA fault XLA logs a 'Failed to unload module' block per loaded program, more than
    the kept tail: the child's error line must still be in the ``BenchError``."""
    from mllm_rl.bench.child import BenchError, run_cmd

    child = tmp_path / "child.py"
    child.write_text(
        "import sys\n"
        "sys.stderr.write('RuntimeError: the real cause\\n')\n"
        "for _ in range(200):\n"
        "    sys.stderr.write('E1130 cuda_executor.cc:313] [0] Failed to unload module 0x1; leaking\\n'\n"
        "                     '=== Source Location Trace: ===\\n'\n"
        "                     'external/xla+/xla/stream_executor/cuda/cuda_status.cc:50\\n\\n')\n"
        "sys.exit(1)\n"
    )
    with pytest.raises(BenchError) as e:
        run_cmd([sys.executable, str(child)], "child")
    tail = str(e.value).split("\n", 1)[1]
    assert tail == "RuntimeError: the real cause", tail[-300:]

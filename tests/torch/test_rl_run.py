"""``python -m mllm_rl.run --backend torch --plan rl`` end to end (embedded engine + torch trainer on CPU).

Runs of 2 steps start together (subprocesses of the torch venv's interpreter, one intra-op
thread each so that they share 2 cores without stalling each other):

- ``full``: full fine-tune, ``multi_stage``, garbage guard on, checkpoints written in the background
  (``--checkpoint-background``; later resumed for a third step);
- ``lora_backup``: LoRA rank 4, engine weights CPU backup, ``naive`` schedule: partial updates;
- ``lora``: LoRA rank 4, no backup: every resumed engine is invalid, so the updates are full;
- ``oom`` / ``offload_noop`` / ``reward_nan``: injected faults (``mllm_rl.faults``) that the run
  must report (``reward_nan``: a NaN reward makes the loss NaN; the run stops with exit 5).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from mllm_rl.phases import validate_record
from mllm_rl.sinks.jsonl import read_jsonl
from mllm_rl.trainer import TRAIN_METRICS
from tests.conftest import run_cli, start_cli
from tests.core.test_cli_errors import ROWS, check_refusal

pytestmark = pytest.mark.slow  # every test here starts an engine (or waits on one that did)

SMALL = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4",
         "--wandb", "disabled", "--check-weights", "--quiet", "--platform", "cpu"]  # fmt: skip
RUNS = {
    "full": ["--checkpoint-every", "1", "--checkpoint-background"],
    "lora_backup": ["--lora-rank", "4", "--weights-cpu-backup", "--schedule", "naive"],
    "lora": ["--lora-rank", "4"],
}
FAULTS = {  # run name: (MLLM_RL_FAULTS, extra flags)
    "oom": ("train_oom", []),
    "offload_noop": ("offload_noop", []),
    "resume_lies": ("resume_lies", ["--lora-rank", "4", "--weights-cpu-backup"]),
    "reward_nan": ("reward_nan", ["--checkpoint-every", "1"]),
}
SLACK = 4096  # bytes of small temporaries another thread may hold while the probe scans


@pytest.fixture(scope="module")
def runs(tiny_ckpt, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    procs = {}
    for name, (faults, extra) in [*((n, ("", x)) for n, x in RUNS.items()), *FAULTS.items()]:
        run_dir = tmp_path_factory.mktemp(f"torch_rl_{name}")
        procs[name] = (start(tiny_ckpt, run_dir, *extra, faults=faults), run_dir)
    return {name: (finish(p), run_dir) for name, (p, run_dir) in procs.items()}


def start(model: Path, run_dir: Path, *extra: str, faults: str = "") -> subprocess.Popen:
    env = {"MLLM_RL_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1", "MLLM_RL_FAULTS": faults}
    return start_cli("mllm_rl.run", "--backend", "torch", "--plan", "rl", "--model", str(model),
                     "--run-dir", str(run_dir), *SMALL, *extra, env=env)  # fmt: skip


def finish(p: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = p.communicate(timeout=600)
    return subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)


def records(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "phases.jsonl")


def by_phase(recs: list[dict], phase: str) -> list[dict]:
    return [r for r in recs if r["phase"] == phase]


@pytest.mark.parametrize("name", list(RUNS))
def test_exits_clean_with_every_phase_in_order_and_schema_valid(runs, name):
    r, run_dir = runs[name]
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    plan = json.loads((run_dir / "run.json").read_text())
    assert plan["backend"] == "torch" and plan["steps"] == 2
    setup, final = plan["expected_phases"][:-2], plan["expected_phases"][-2:]
    assert (
        setup[1] == "torch_ready"
        and final == ["checkpoint_flush", "generate_result"]
        and "check_weights" in plan["expected_step_phases"]
    )
    recs = records(run_dir)
    want = setup + plan["expected_step_phases"] * 2 + final
    assert [x["phase"] for x in recs] == want
    steps = [x["step"] for x in recs]
    n = len(plan["expected_step_phases"])
    assert steps == [None] * len(setup) + [0] * n + [1] * n + [None, None]
    for i, x in enumerate(recs):
        validate_record(x)
        assert x["backend"] == "torch"
        if i >= 2:  # the probe is installed at the end of torch_ready
            assert [d["source"] for d in x["memory"]["devices"]] == ["live_tensors"]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert set(TRAIN_METRICS) <= set(m) and "reward_mean" in m and m["updates"] == 1 and m["tokens"] > 0
    assert (run_dir / "checkpoints" / "step_000001" / "state.pt").exists()  # the last step is saved


@pytest.mark.parametrize("name", list(RUNS))
def test_every_update_landed_and_the_garbage_guard_agrees(runs, name):
    recs = records(runs[name][1])
    assert by_phase(recs, "weights_swapped")[0]["info"]["full"] is True
    updates = by_phase(recs, "update_weights")
    assert len(updates) == 2 and all(u["info"]["fingerprint_ok"] for u in updates)
    # the lifecycle's choice: partial (LoRA) only onto base weights that survived the release
    assert [u["info"]["full"] for u in updates] == [name != "lora_backup"] * 2
    if name == "lora_backup":
        assert all(u["info"]["tensors"] == 14 for u in updates)  # 7 linear layers x 2 decoder layers
    else:
        assert all(u["info"]["tensors"] == 25 for u in updates)
    for c in by_phase(recs, "check_weights"):
        assert c["info"]["agree_until"] == len(c["info"]["trainer_tokens"]) or c["info"].get("near_tie")


@pytest.mark.parametrize("name", ["full", "lora"])
def test_the_probe_sees_the_trainer_leave_and_come_back(runs, name):
    recs = records(runs[name][1])
    state = by_phase(recs, "trainer_init")[0]["info"]["state_bytes"]
    if name == "full":
        assert state["optimizer"] > 2 * state["params"]  # exp_avg + exp_avg_sq (+ step counters)
    else:
        assert 0 < state["optimizer"] < state["params"] / 10  # adapters only
    for phase, key, sign in (("onload_trainer", "expected_alloc_bytes", 1),
                             ("offload_optimizer", "expected_freed_bytes", -1),
                             ("offload_trainer_params", "expected_freed_bytes", -1)):  # fmt: skip
        for x in by_phase(recs, phase):
            dev = x["memory"]["devices"][0]
            want = x["info"][key]
            assert (
                want > 0 and abs(sign * (dev["bytes_in_use"] - dev["bytes_in_use_start"]) - want) <= SLACK
            ), phase
    assert (
        by_phase(recs, "onload_trainer")[0]["info"]["expected_alloc_bytes"]
        == state["params"] + state["optimizer"]
    )
    for x in by_phase(recs, "offload_trainer_params"):
        assert x["info"]["trainer"] == {"params": False, "optimizer": False}


def test_naive_schedule_resumes_everything_before_the_update(runs):
    recs = records(runs["lora_backup"][1])
    stepped = [x for x in recs if x["step"] is not None]
    assert not by_phase(stepped, "resume_weights") and len(by_phase(stepped, "resume_rollout")) == 2
    for u in by_phase(recs, "update_weights"):
        assert u["info"]["engine"]["released"] == []


def test_lora_without_backup_invalidates_the_engine_until_the_full_update(runs):
    recs = records(runs["lora"][1])
    for x in by_phase(recs, "resume_weights"):
        assert x["info"]["engine"]["weights_valid"] is False
    for x in by_phase(recs, "update_weights"):
        assert x["info"]["engine"]["weights_valid"] is True


def test_injected_oom_fails_the_train_step_phase_with_exit_1(runs):
    r, run_dir = runs["oom"]
    assert r.returncode == 1 and "error: OutOfMemoryError: CUDA out of memory" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    last = records(run_dir)[-1]
    assert (
        last["phase"] == "train_step" and last["step"] == 0 and "injected: train_oom" in last["info"]["error"]
    )
    assert last["memory"]["devices"][0]["bytes_in_use"] > 0


def test_trainer_that_does_not_offload_breaks_the_residency_invariant(runs):
    r, run_dir = runs["offload_noop"]
    assert r.returncode == 4 and "both resident" in r.stderr, r.stderr[-3000:]
    last = records(run_dir)[-1]
    assert last["phase"] == "offload_trainer_params" and last["step"] is None  # the setup's
    assert "LifecycleError" in last["info"]["error"]


def test_garbage_guard_catches_weights_that_resume_lied_about(runs):
    """The LoRA garbage-output bug: weights resumed without their backup (zeros) but believed valid, then a LoRA
    partial sync: every synced tensor's fingerprint is right, the output is garbage."""
    r, run_dir = runs["resume_lies"]
    assert r.returncode == 3 and "garbage output" in r.stderr, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    recs = records(run_dir)
    assert recs[-1]["phase"] == "check_weights" and recs[-1]["step"] == 0
    assert "WeightMismatch" in recs[-1]["info"]["error"]
    assert [u["info"]["full"] for u in by_phase(recs, "update_weights")] == [False]


def test_resume_restores_the_last_checkpoint_and_runs_the_remaining_step(runs, tiny_ckpt, tmp_path):
    """Resumed with ``--run-dir`` alone (and the new ``--steps``): the backend, the model and
    ``--wandb disabled`` come from ``run.json`` (no W&B run is made)."""
    run_dir = tmp_path / "resumed"
    shutil.copytree(runs["full"][1], run_dir)
    r = run_cli("mllm_rl.run", "--run-dir", str(run_dir), "--resume", "--steps", "3",
                env={"MLLM_RL_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (run_dir / "wandb").exists()
    recs = records(run_dir)
    inits = by_phase(recs, "trainer_init")
    assert len(inits) == 2 and inits[1]["info"]["restored_from"].endswith("checkpoints/step_000001")
    assert [x["step"] for x in by_phase(recs, "train_step")] == [0, 1, 2]
    assert [x["idx"] for x in recs] == list(range(len(recs)))  # the resumed attempt appends to the phase log
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [0, 1, 2]
    assert (run_dir / "checkpoints" / "step_000002" / "state.pt").exists()


def test_checkpoints_are_written_in_the_background_and_recorded_once_written(runs):
    """``full`` saves steps 0 and 1 from host snapshots: each checkpoint phase begins a write
    (not yet saved); step 0's end is recorded by step 1's checkpoint phase, step 1's by
    ``checkpoint_flush``. ``lora_backup`` (the default) saves its last step in the phase."""
    recs = records(runs["full"][1])
    ck = [c["info"] for c in by_phase(recs, "checkpoint")]
    assert [(c["saved"], c.get("background")) for c in ck] == [(False, True), (False, True)]
    assert all(c["snapshot_bytes"] > 0 for c in ck) and "written" not in ck[0]
    assert [(w["step"], w["path"]) for w in ck[1]["written"]] == [(0, ck[0]["path"])]
    (flush,) = by_phase(recs, "checkpoint_flush")
    assert [(w["step"], w["path"]) for w in flush["info"]["written"]] == [(1, ck[1]["path"])]
    assert flush["idx"] < by_phase(recs, "generate_result")[0]["idx"]
    sync = [c["info"] for c in by_phase(records(runs["lora_backup"][1]), "checkpoint")]
    assert [(c["saved"], c.get("background")) for c in sync] == [(False, None), (True, None)]
    assert by_phase(records(runs["lora_backup"][1]), "checkpoint_flush")[0]["info"]["written"] == []


def strict_json(text: str):
    """``json.loads`` that refuses bare NaN / Infinity (not JSON)."""

    def refuse(name: str):
        raise ValueError(f"bare {name} in JSON")

    return json.loads(text, parse_constant=refuse)


def test_nan_loss_stops_the_run_with_exit_5_before_its_checkpoint(runs):
    r, run_dir = runs["reward_nan"]
    assert r.returncode == 5, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: train_step of step 0: non-finite loss nan")
    last = records(run_dir)[-1]
    assert last["phase"] == "train_step" and last["step"] == 0
    assert last["info"]["loss"] == "NaN" and "loss" in last["info"]["non_finite"]
    assert not (run_dir / "checkpoints").exists()  # --checkpoint-every 1, but the step stopped before it
    for line in (run_dir / "phases.jsonl").read_text().splitlines():
        strict_json(line)
    summary = strict_json((run_dir / "report" / "summary.json").read_text())
    strict_json((run_dir / "report" / "trace.json").read_text())
    kinds = {i["kind"] for i in summary["issues"] if i["severity"] == "error"}
    assert "non_finite" in kinds and "phase_error" not in kinds


def test_resume_skips_a_truncated_newest_checkpoint_and_finishes_from_the_older(runs, tiny_ckpt, tmp_path):
    """``full`` saved steps 0 and 1 (the last); step 1's state file is truncated: --resume says so,
    restores step 0, re-runs step 1 and runs step 2; the report finds no error."""
    run_dir = tmp_path / "resumed"
    shutil.copytree(runs["full"][1], run_dir)
    state = run_dir / "checkpoints" / "step_000001" / "state.pt"
    with open(state, "r+b") as f:
        f.truncate(state.stat().st_size // 2)
    r = finish(start(tiny_ckpt, run_dir, "--resume", "--steps", "3"))
    assert r.returncode == 0, r.stderr[-3000:]
    inits = by_phase(records(run_dir), "trainer_init")
    assert inits[1]["info"]["restored_from"].endswith("checkpoints/step_000000")
    assert [x["step"] for x in by_phase(records(run_dir), "train_step")] == [0, 1, 1, 2]
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert [i for i in summary["issues"] if i["severity"] == "error"] == []


TORCH_ROWS = [row for row in ROWS if "--backend torch" in row[0] and row[3] == "runtime"]


@pytest.mark.parametrize("row", TORCH_ROWS, ids=[r[0] for r in TORCH_ROWS])
def test_refusals_checked_once_the_torch_runtime_is_up(row, tmp_path, monkeypatch, capfd):
    """The torch rows of docs/ERRORS.md (the core test skips them outside the torch venv)."""
    assert TORCH_ROWS
    check_refusal(row, tmp_path, monkeypatch, capfd)

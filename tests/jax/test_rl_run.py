"""``python -m mllm_rl.run --backend jax --plan rl``: colocated GRPO on a real sglang-jax engine
and the flax trainer (JAX CPU), every phase checked: >= 2 steps per run that succeeds, one step for
a run that must stop at a fault.

Each run is a subprocess (an sglang-jax engine must not live in pytest's process).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest

from mllm_rl import hugepages
from mllm_rl.phases import validate_record
from mllm_rl.sinks.jsonl import read_jsonl
from mllm_rl.trainer import TRAIN_METRICS
from tests.conftest import run_cli, start_cli
from tests.jax.test_jax_checkpoint_faults import orbax_compressors

SMALL = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4",
         "--max-running-requests", "8", "--checkpoint-every", "1"]  # fmt: skip


# The fault runs stop in step 0 (or the setup): one step, the shapes of SMALL (their functions are
# compiled once per session, shared with the other runs), nothing optional.
ONE_STEP = ["--steps", "1", "--wandb", "disabled"]


def rl_args(run_dir: Path, model: Path, *extra: str) -> list[str]:
    return ["mllm_rl.run", "--backend", "jax", "--plan", "rl", "--model", str(model), "--run-dir", str(run_dir),
            "--console", "off", *SMALL, *extra]  # fmt: skip


def rl_run(run_dir: Path, model: Path, *extra: str, env: dict[str, str] | None = None):
    return run_cli(*rl_args(run_dir, model, *extra), env=env, timeout=900)


def records(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "phases.jsonl")


def by_step(recs: list[dict]) -> dict[int | None, list[dict]]:
    out: dict[int | None, list[dict]] = {}
    for r in recs:
        out.setdefault(r["step"], []).append(r)
    return out


def phase(recs: list[dict], name: str, step: int | None) -> dict:
    (r,) = [x for x in recs if x["phase"] == name and x["step"] == step]
    return r


def freed(r: dict) -> int:
    return sum(d["bytes_in_use_start"] - d["bytes_in_use"] for d in r["memory"]["devices"])


@pytest.fixture(scope="module")
def lora_lr0(tiny_ckpt, tmp_path_factory):
    """LoRA, no CPU backup, lr 0 (weights never change), garbage guard on, W&B offline; what the
    console prints by default (``--console steps``)."""
    run_dir = tmp_path_factory.mktemp("rl_lora_lr0")
    r = rl_run(run_dir, tiny_ckpt, "--lora-rank", "4", "--lr", "0", "--check-weights", "--wandb", "offline",
               "--console", "steps")  # fmt: skip
    return r, run_dir


@pytest.mark.slow
def test_every_phase_of_every_step_is_recorded_in_order(lora_lr0):
    r, run_dir = lora_lr0
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    plan = json.loads((run_dir / "run.json").read_text())
    recs = records(run_dir)
    for x in recs:
        validate_record(x)
        assert "error" not in x["info"], x
    steps = by_step(recs)
    assert [x["phase"] for x in steps[None]] == plan["expected_phases"]
    assert plan["expected_step_phases"][-1] == "check_weights"
    for s in (0, 1):
        assert [x["phase"] for x in steps[s]] == plan["expected_step_phases"]
    assert [x["idx"] for x in recs] == list(range(len(recs)))
    # the run compiled through the persistent cache the tests share (backends/jax/compile_cache.py)
    assert phase(recs, "jax_ready", None)["info"]["compile_cache"] == os.environ["JAX_COMPILATION_CACHE_DIR"]
    # and with the allocator settings a run started as a program gives itself (mllm_rl/hugepages.py)
    assert phase(recs, "jax_ready", None)["info"]["hugepages"] == hugepages.state()
    # its checkpoint's arrays are written raw (no --checkpoint-compression)
    assert orbax_compressors(run_dir / "checkpoints" / "step_000001" / "state") == {None}


@pytest.mark.slow
def test_the_console_shows_one_line_per_step_and_no_phase_lines(lora_lr0):
    """By default: the setup in one line, then one line per step with the watched numbers (its
    step count, reward, KL, clip fraction, grad norm, loss, time and peak memory), once (the end's
    summary does not repeat them), and no phase line; the records are all in phases.jsonl."""
    r, run_dir = lora_lr0
    assert r.returncode == 0, r.stderr[-3000:]
    assert not [x for x in r.stdout.splitlines() if x.startswith("phase ")], r.stdout[-3000:]
    lines = r.stderr.splitlines()
    assert len([x for x in lines if x.startswith("setup: ")]) == 1, lines
    steps = [x for x in lines if re.match(r"step \d+ ", x)]
    assert [x.split(":")[0] for x in steps] == ["step 0 (1/2)", "step 1 (2/2)"], lines
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    for line, m in zip(steps, metrics, strict=True):
        for key in ("reward_mean", "kl", "clip_frac", "grad_norm", "loss"):
            assert f" {key}={m[key]:.3g} " in line, (key, line)
        for key in ("step_s", "dev_peak", "rss_peak"):
            assert f" {key}=" in line, (key, line)
    assert len(records(run_dir)) > 2 * 10


@pytest.mark.slow
def test_release_and_offload_free_what_they_hold(lora_lr0):
    _, run_dir = lora_lr0
    recs = records(run_dir)
    for s in (0, 1):
        for name in ("release_rollout", "offload_optimizer", "offload_trainer_params"):
            x = phase(recs, name, s)
            assert x["info"]["expected_freed_bytes"] > 0
            assert freed(x) >= 0.99 * x["info"]["expected_freed_bytes"], (name, s)
        held = phase(recs, "release_rollout", s)["info"]["held"]
        assert set(held) == {"kv_cache", "weights"}


@pytest.mark.slow
def test_trainer_params_and_engine_weights_never_both_resident_outside_the_update(lora_lr0):
    _, run_dir = lora_lr0
    allowed = {"resume_weights", "update_weights", "weights_swapped"}
    for x in records(run_dir):
        info = x["info"]
        if "trainer" not in info or "engine" not in info:
            continue
        both = info["trainer"]["params"] and "weights" not in info["engine"]["released"]
        assert not both or x["phase"] in allowed, x["phase"]


@pytest.mark.slow
def test_update_without_backup_is_full_and_fingerprinted(lora_lr0):
    _, run_dir = lora_lr0
    recs = records(run_dir)
    for s in (0, 1):
        info = phase(recs, "update_weights", s)["info"]
        # LoRA would send only the adapters' layers, but the engine resumed without a CPU
        # backup: its base weights are undefined, so the lifecycle must send everything.
        assert info["full"] is True and info["fingerprint_ok"] is True and info["tensors"] == 25


@pytest.mark.slow
def test_garbage_guard_greedy_probe_identical_before_release_and_after_update(lora_lr0):
    _, run_dir = lora_lr0
    recs = records(run_dir)
    for s in (0, 1):
        before = phase(recs, "rollout", s)["info"]["probe_tokens"]
        after = phase(recs, "check_weights", s)["info"]
        assert len(before) == 8 and after["probe_tokens"] == before  # lr 0: the same weights
        assert after["trainer_tokens"] == before and after["agree_until"] == 8


@pytest.mark.slow
def test_wandb_has_one_point_per_step_per_rl_metric(lora_lr0):
    from mllm_rl.sinks.wandb_file import read_history

    _, run_dir = lora_lr0
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = read_history(run_file)
    for key in ("train/reward_mean", "train/loss", "train/grad_norm", "train/kl"):
        assert [row["rl/step"] for row in rows if key in row] == [0, 1], key
    assert sum("phase/name" in row for row in rows) == len(records(run_dir))
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in lines] == [0, 1] and all("reward_mean" in m for m in lines)
    assert all(set(TRAIN_METRICS) <= set(m) and m["updates"] >= 1 and m["tokens"] > 0 for m in lines)


@pytest.mark.slow
def test_report_is_written_and_finds_the_run_complete(lora_lr0):
    _, run_dir = lora_lr0
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert [i for i in summary["issues"] if i["severity"] == "error"] == []
    trace = json.loads((run_dir / "report" / "trace.json").read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"release_rollout", "update_weights", "resume_kv"} <= names


@pytest.fixture(scope="module")
def lora_backup_naive(tiny_ckpt, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("rl_lora_naive")
    r = rl_run(run_dir, tiny_ckpt, "--lora-rank", "4", "--weights-cpu-backup", "--check-weights",
               "--schedule", "naive", "--wandb", "disabled", "--console", "phases")  # fmt: skip
    return r, run_dir


@pytest.mark.slow
def test_console_phases_prints_one_line_per_phase_record(lora_backup_naive):
    """``--console phases``: one short line per record on stdout, in the records' order, and the
    step lines on stderr as by default."""
    r, run_dir = lora_backup_naive
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [x for x in r.stdout.splitlines() if x.startswith("phase ")]
    recs = records(run_dir)
    assert [x.split()[1:3] for x in lines] == [[str(x["idx"]), x["phase"]] for x in recs], r.stdout[-3000:]
    assert len([x for x in r.stderr.splitlines() if re.match(r"step \d+ \(", x)]) == 2, r.stderr[-3000:]


@pytest.mark.slow
def test_lora_with_backup_sends_only_the_adapted_layers(lora_backup_naive):
    r, run_dir = lora_backup_naive
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(run_dir)
    for s in (0, 1):
        info = phase(recs, "update_weights", s)["info"]
        assert info["full"] is False and info["tensors"] == 14  # 7 projections x 2 layers
        assert phase(recs, "check_weights", s)["info"]["agree_until"] > 0


@pytest.mark.slow
def test_naive_schedule_peaks_with_kv_cache_weights_and_trainer_together(lora_backup_naive, lora_lr0):
    recs_naive, recs_multi = records(lora_backup_naive[1]), records(lora_lr0[1])
    plan = json.loads((lora_backup_naive[1] / "run.json").read_text())
    assert [x["phase"] for x in by_step(recs_naive)[1]] == plan["expected_step_phases"]
    assert (
        "resume_rollout" in plan["expected_step_phases"] and "resume_kv" not in plan["expected_step_phases"]
    )
    kv = phase(recs_multi, "release_rollout", 1)["info"]["held"]["kv_cache"]

    def peak(recs):
        return phase(recs, "update_weights", 1)["memory"]["devices"][0]["phase_peak_bytes"]

    assert peak(recs_naive) >= peak(recs_multi) + 0.99 * kv


@pytest.mark.slow
def test_garbage_guard_catches_weights_that_resume_lied_about(tiny_ckpt, tmp_path):
    """The LoRA garbage-output bug: weights resumed without a backup (zeros) but believed valid, then a LoRA
    partial sync: the fingerprint of the synced tensors is right, the output is garbage."""
    r = rl_run(tmp_path, tiny_ckpt, *ONE_STEP, "--lora-rank", "4", "--weights-cpu-backup", "--check-weights",
               env={"MLLM_RL_FAULTS": "resume_lies"})  # fmt: skip
    assert r.returncode == 3, r.stderr[-3000:]
    assert "garbage output" in r.stderr and "Traceback" not in r.stderr
    last = records(tmp_path)[-1]
    assert last["phase"] == "check_weights" and last["step"] == 0
    assert "WeightMismatch" in last["info"]["error"]
    assert phase(records(tmp_path), "update_weights", 0)["info"]["full"] is False


@pytest.mark.slow
def test_injected_oom_names_the_phase_and_the_memory_in_use(tiny_ckpt, tmp_path):
    r = rl_run(tmp_path, tiny_ckpt, *ONE_STEP, env={"MLLM_RL_FAULTS": "train_oom"})
    assert r.returncode == 1 and "RESOURCE_EXHAUSTED" in r.stderr
    last = records(tmp_path)[-1]
    assert last["phase"] == "train_step" and last["step"] == 0
    assert "RESOURCE_EXHAUSTED" in last["info"]["error"]
    assert last["memory"]["devices"][0]["bytes_in_use"] > 0


@pytest.mark.slow
def test_trainer_that_does_not_offload_breaks_the_residency_invariant(tiny_ckpt, tmp_path):
    r = rl_run(tmp_path, tiny_ckpt, *ONE_STEP, env={"MLLM_RL_FAULTS": "offload_noop"})
    assert r.returncode == 4, r.stderr[-3000:]
    assert "both resident" in r.stderr
    last = records(tmp_path)[-1]
    assert last["phase"] == "offload_trainer_params" and last["step"] is None  # the setup's
    assert "LifecycleError" in last["info"]["error"]


@pytest.mark.slow
def test_kill_and_resume_continues_from_the_last_checkpoint_on_two_devices(tiny_ckpt, tmp_path):
    """A run SIGKILLed once step 1's checkpoint (zstd-compressed) is saved resumes from it, runs
    step 2, and its log continues intact. It runs with --tp 2 on two CPU devices (both parts): the trainer's params and
    optimizer state are sharded over a 2-device mesh (a replicated scalar on one device only broke
    the step once), the engine is tp=2, and the garbage guard checks the synced weights."""
    args = rl_args(tmp_path, tiny_ckpt, "--steps", "3", "--tp", "2", "--check-weights", "--wandb", "disabled",
                   "--checkpoint-compression")  # fmt: skip
    p = start_cli(*args, env={"MLLM_RL_NO_PROGRESS": "1"})
    phases, deadline = tmp_path / "phases.jsonl", time.time() + 600
    while time.time() < deadline and p.poll() is None:
        done = phases.exists() and any(
            x["phase"] == "checkpoint" and x["step"] == 1 and x["info"].get("saved")
            for x in read_jsonl(phases)
        )
        if done:
            break
        time.sleep(0.1)
    assert p.poll() is None, p.communicate()[1][-3000:]  # killed mid-run, not after it ended
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=60)
    assert (tmp_path / "checkpoints" / "step_000001" / "meta.json").exists()
    assert orbax_compressors(tmp_path / "checkpoints" / "step_000001" / "state") == {"zstd"}
    r = run_cli(*args, "--resume", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(tmp_path)
    starts = [i for i, x in enumerate(recs) if x["phase"] == "wandb_init"]
    assert len(starts) == 2
    second = recs[starts[1] :]
    assert phase(second, "trainer_init", None)["info"]["restored_from"].endswith("step_000001")
    assert sorted({x["step"] for x in second if x["step"] is not None}) == [2]
    assert [x["idx"] for x in recs] == list(range(len(recs)))  # the log continues, intact
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert [i for i in summary["issues"] if i["severity"] == "error"] == []
    # two devices: step 0 of the killed run and step 2 of the resumed one, both complete
    for s, part in ((0, recs[: starts[1]]), (2, second)):
        rel = phase(part, "release_rollout", s)
        assert [d["id"] for d in rel["memory"]["devices"]] == [0, 1]
        assert all(d["bytes_in_use_start"] - d["bytes_in_use"] > 0 for d in rel["memory"]["devices"])
        onload = phase(part, "onload_trainer", s)
        assert all(d["bytes_in_use"] > d["bytes_in_use_start"] for d in onload["memory"]["devices"])
        assert phase(part, "check_weights", s)["info"]["agree_until"] > 0


@pytest.mark.slow  # starts an engine
def test_resume_skips_a_truncated_newest_checkpoint_and_finishes_from_the_older(
    lora_lr0, tiny_ckpt, tmp_path
):
    """The LoRA run saved steps 0 and 1; one file of step 1's orbax state is truncated. --resume names
    it, restores step 0, re-runs step 1, runs step 2, and the report of the whole run is clean."""
    r0, src = lora_lr0
    assert r0.returncode == 0, r0.stderr[-3000:]
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir)
    biggest = max((p for p in (run_dir / "checkpoints" / "step_000001").rglob("*") if p.is_file()),
                  key=lambda p: p.stat().st_size)  # fmt: skip
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 2)
    r = rl_run(run_dir, tiny_ckpt, "--lora-rank", "4", "--lr", "0", "--check-weights", "--wandb", "offline",
               "--steps", "3", "--resume")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    skipped = [x for x in r.stderr.splitlines() if x.startswith("resume: skipped step_000001: ")]
    assert len(skipped) == 1 and f"{biggest}: " in skipped[0] and "(truncated or rewritten)" in skipped[0]
    recs = records(run_dir)
    inits = [x for x in recs if x["phase"] == "trainer_init"]
    assert len(inits) == 2 and inits[1]["info"]["restored_from"].endswith("checkpoints/step_000000")
    assert [x["step"] for x in recs if x["phase"] == "train_step"] == [0, 1, 1, 2]
    assert json.loads((run_dir / "run.json").read_text())["steps"] == 3
    summary = json.loads((run_dir / "report" / "summary.json").read_text())
    assert [i for i in summary["issues"] if i["severity"] == "error"] == []


@pytest.mark.slow  # starts an engine
def test_a_train_step_that_never_ends_is_dumped_and_exits_6(tiny_ckpt, tmp_path):
    """Fault ``hang=train_step``: the phase sleeps; the watchdog dumps every thread (the engine's
    included) into the run dir, records the phase as stuck and the run exits 6 instead of hanging."""
    t0 = time.monotonic()
    r = rl_run(tmp_path, tiny_ckpt, *ONE_STEP, "--phase-timeout", "train_step=5",
               env={"MLLM_RL_FAULTS": "hang=train_step"})  # fmt: skip
    assert r.returncode == 6, r.stderr[-3000:]
    assert time.monotonic() - t0 < 600 and "Traceback" not in r.stderr
    (stacks,) = tmp_path.glob("stuck-*.txt")
    assert stacks.name == "stuck-train_step-step0-p0.txt"
    dump = stacks.read_text()
    assert "injected_hang" in dump and dump.count("\nThread ") >= 4  # main, watchdog, sampler, engine threads
    last = records(tmp_path)[-1]
    assert last["phase"] == "train_step" and last["step"] == 0 and last["info"]["stuck"]["limit_s"] == 5.0
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert "stuck_phase" in {i["kind"] for i in summary["issues"] if i["severity"] == "error"}


def test_resume_needs_a_run_to_continue(tiny_ckpt):
    r = run_cli("mllm_rl.run", "--backend", "jax", "--model", str(tiny_ckpt), "--resume")
    assert r.returncode == 2 and "--resume needs --run-dir or --run-id" in r.stderr


@pytest.mark.slow
def test_reward_rises_on_the_embedded_default(tmp_path):
    """The README's run command (defaults: tiny preset from random init, pattern task),
    shortened to 6 steps: the mean reward must rise clearly (seed 0: 0.01, 0.012, 0.09, 0.24, 0.28,
    0.42, so the last two steps beat the first two by ~0.34; it goes on to ~0.55 by step 8)."""
    r = run_cli("mllm_rl.run", "--backend", "jax", "--run-dir", str(tmp_path), "--steps", "6", "--quiet",
                "--wandb", "disabled", "--checkpoint-every", "0", timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == ""  # --quiet: only errors, and there are none
    rewards = [m["reward_mean"] for m in read_jsonl(tmp_path / "metrics.jsonl")]
    assert len(rewards) == 6
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.2, rewards

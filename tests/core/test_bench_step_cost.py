"""``mllm_rl.bench.step_cost``: the analysis, and the benchmark ``python -m mllm_rl.bench step-cost``.

Fast tests read phase logs written by the real recorder (``PhaseRecorder`` + ``JsonlSink``) while
the real lifecycle (``Colocated``) drives the named fakes of ``tests/fakes.py`` through setup and
steps; the rollout and the train step sleep for known times, so where a step's time goes is
known. The slow test runs the script on real ``python -m mllm_rl.run`` runs (tiny, both backends).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mllm_rl.bench.step_cost import BETWEEN, analyse, counted, split_steps
from mllm_rl.engine import SamplingParams
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.lifecycle import LifecycleOptions, colocate, step_phases
from mllm_rl.phases import PhaseRecorder
from mllm_rl.rl.advantages import group_advantages
from mllm_rl.rl.batch import build_batch
from mllm_rl.sinks.jsonl import JsonlSink, read_jsonl
from tests.conftest import ROOT
from tests.fakes import FakeBackend, FakeDevice, FakeEngine, FakeProbe, FakeTrainer, initial_weights, nbytes

BENCH = [sys.executable, "-m", "mllm_rl.bench", "step-cost"]
ROLLOUT_S, TRAIN_S, FIRST_EXTRA_S = 0.12, 0.06, 0.5
W = nbytes(initial_weights())  # fake engine weights == fake trainer params; optimizer state = 2 W


def slow_rollout(engine: ManagedEngine, step: int) -> tuple[Any, dict[str, Any]]:
    """2 prompts x 2 samples; sleeps ``ROLLOUT_S`` (+ ``FIRST_EXTRA_S`` in step 0: 'compilation')."""
    time.sleep(ROLLOUT_S + (FIRST_EXTRA_S if step == 0 else 0.0))
    ids = [p for p in ([1, 2, 3], [4, 5]) for _ in range(2)]
    outs = engine.generate(ids, SamplingParams(max_new_tokens=4, temperature=1.0, seed=step))
    rewards = np.array([float(o.token_ids[0] % 2) for o in outs])
    return build_batch(ids, outs, group_advantages(rewards, 2)), {"reward_mean": float(rewards.mean())}


def record_run(
    run_dir: Path,
    steps: range,
    fail_train_at: int | None = None,
    sample: bool = False,
    save_s: float = 0.0,
    background: bool = False,
) -> list[str]:
    """Setup + ``steps`` of the real lifecycle on the fakes, appended to ``run_dir/phases.jsonl``
    (a second call is a resumed attempt), plus the ``run.json`` fields the script reads."""
    device = FakeDevice()
    engine = ManagedEngine(FakeEngine(device))
    rec = PhaseRecorder("fake-run", "fake", sinks=[JsonlSink(run_dir / "phases.jsonl")], probe=FakeProbe(device),
                        sample_interval_s=0.005 if sample else 0)  # fmt: skip
    opts = LifecycleOptions()
    holder: dict[str, FakeTrainer] = {}

    def make_trainer() -> tuple[FakeTrainer, dict[str, Any]]:
        t = holder["t"] = FakeTrainer(device)
        real = t.train_step

        def train_step(batch):
            if batch is not None and fail_train_at == life_step[0]:
                raise MemoryError("fake device out of memory")
            time.sleep(TRAIN_S)
            return real(batch)

        t.train_step = train_step
        return t, {}

    life_step = [-1]
    saved = {"saved": False, "background": True} if background else {"saved": True}
    life = colocate(FakeBackend(), engine, rec, opts, make_trainer)
    life.first_sync()
    try:
        for s in steps:
            life_step[0] = s
            save = (lambda step: time.sleep(save_s) or {**saved, "path": str(run_dir)}) if save_s else None
            life.step(s, slow_rollout, save=save)
    finally:
        rec.close()
    meta = {"plan": "rl", "backend": "fake", "expected_step_phases": step_phases(opts),
            "argv": ["--backend", "fake", "--model", "fake-model", "--steps", str(len(steps))]}  # fmt: skip
    (run_dir / "run.json").write_text(json.dumps(meta))
    return step_phases(opts)


def test_shares_medians_and_bytes_of_a_recorded_run(tmp_path):
    expected = record_run(tmp_path, range(3))
    records = read_jsonl(tmp_path / "phases.jsonl")
    a = analyse(records, expected)
    assert a["steps_recorded"] == 3 and a["steps_counted"] == [1, 2]  # step 0 "compiles"
    by = {p["phase"]: p for p in a["phases"]}
    assert list(by) == [*expected[:11], "empty_cache#2", *expected[12:], BETWEEN]
    # independently: each counted step's wall time and rollout share from the raw records
    walls, rollout_share = [], []
    for s in (1, 2):
        recs = [r for r in records if r["step"] == s]
        wall = recs[-1]["t_end"] - recs[0]["t_start"]
        walls.append(wall)
        (ro,) = [r for r in recs if r["phase"] == "rollout"]
        rollout_share.append((ro["t_end"] - ro["t_start"]) / wall)
    assert a["step_s_median"] == pytest.approx(np.median(walls), abs=1e-6)
    assert by["rollout"]["share_median"] == pytest.approx(np.median(rollout_share), abs=1e-6)
    assert by["rollout"]["seconds_median"] >= ROLLOUT_S and by["train_step"]["seconds_median"] >= TRAIN_S
    # the first step slept FIRST_EXTRA_S more: it is reported (its own wall time), not counted
    recs0 = [r for r in records if r["step"] == 0]
    assert a["first_step_s"] == pytest.approx(recs0[-1]["t_end"] - recs0[0]["t_start"], abs=1e-6)
    assert a["first_step_s"] >= FIRST_EXTRA_S + ROLLOUT_S + TRAIN_S and 0 not in a["steps_counted"]
    assert a["other_share_median"] == pytest.approx(
        np.median(
            [1 - by_s["rollout"] / w - by_s["train_step"] / w for by_s, w in _per_step(records, walls)]
        ),
        abs=1e-6,
    )
    # bytes moved, from the fakes' exact ledger
    assert by["onload_trainer"]["bytes_median"] == 3 * W  # params + optimizer (2 W)
    assert by["offload_optimizer"]["bytes_median"] == 2 * W
    assert by["update_weights"]["bytes_median"] == W and by["update_weights"]["gbps_median"] > 0
    assert by["drain"]["bytes_median"] is None
    assert a["update"]["updates"] == 2 and a["update"]["full_updates"] == 2  # resumed without CPU backup
    assert a["checkpoints_saved"] == 0


def test_the_share_with_a_checkpoint_every_n_steps_spreads_each_save_over_n(tmp_path):
    expected = record_run(tmp_path, range(3), save_s=0.1)
    records = read_jsonl(tmp_path / "phases.jsonl")
    a = analyse(records, expected, cadence=5)
    assert a["checkpoints_saved"] == 2 and a["cadence"] == 5
    want = []
    for s in (1, 2):  # independently, from the raw records
        secs = {r["phase"]: r["t_end"] - r["t_start"] for r in records if r["step"] == s}
        recs = [r for r in records if r["step"] == s]
        wall = recs[-1]["t_end"] - recs[0]["t_start"] - secs["checkpoint"] * (1 - 1 / 5)
        want.append((wall - secs["rollout"] - secs["train_step"]) / wall)
    assert a["other_share_at_cadence"] == pytest.approx(np.median(want), abs=1e-6)
    assert a["other_share_at_cadence"] < a["other_share_median"]  # a 0.1 s save, a fifth of it per step
    assert analyse(records, expected)["other_share_at_cadence"] is None  # not asked for
    others = [
        w * (1 - by_s["rollout"] / w - by_s["train_step"] / w)
        for by_s, w in _per_step(records, _walls(records))
    ]
    assert a["other_share_total"] == pytest.approx(sum(others) / sum(_walls(records)), abs=1e-6)


def _walls(records: list[dict[str, Any]]) -> list[float]:
    return [
        max(r["t_end"] for r in records if r["step"] == s)
        - min(r["t_start"] for r in records if r["step"] == s)
        for s in (1, 2)
    ]


def test_a_background_save_is_not_spread_over_the_cadence(tmp_path):
    """A save written in the background costs in the phases it overlaps too: the cadence figure is
    not derived from it (``None``); the time-weighted share over the counted steps still is."""
    expected = record_run(tmp_path, range(3), save_s=0.05, background=True)
    a = analyse(read_jsonl(tmp_path / "phases.jsonl"), expected, cadence=5)
    assert (a["checkpoints_saved"], a["checkpoints_background"]) == (2, 2)
    assert a["other_share_at_cadence"] is None and 0 < a["other_share_total"] < 1


def _per_step(records: list[dict[str, Any]], walls: list[float]):
    for s, w in zip((1, 2), walls, strict=True):
        yield {r["phase"]: r["t_end"] - r["t_start"] for r in records if r["step"] == s}, w


def test_one_counted_step_shares_add_up_to_one(tmp_path):
    expected = record_run(tmp_path, range(2))
    a = analyse(read_jsonl(tmp_path / "phases.jsonl"), expected)
    assert a["steps_counted"] == [1]
    assert sum(p["share_median"] for p in a["phases"]) == pytest.approx(1.0, abs=1e-5)
    by = {p["phase"]: p for p in a["phases"]}
    assert a["other_share_median"] == pytest.approx(
        1 - by["rollout"]["share_median"] - by["train_step"]["share_median"], abs=1e-5
    )
    assert by[BETWEEN]["seconds_median"] >= 0


def test_the_first_step_of_a_resumed_attempt_and_failed_steps_do_not_count(tmp_path):
    expected = record_run(tmp_path, range(3))
    with pytest.raises(MemoryError):
        record_run(tmp_path, range(3, 5), fail_train_at=4)  # resumed at 3; step 4 fails in train_step
    record_run(tmp_path, range(4, 6))  # resumed again at 4
    steps = split_steps(read_jsonl(tmp_path / "phases.jsonl"))
    assert [(s.attempt, s.step, s.first_of_attempt) for s in steps] == [
        (0, 0, True), (0, 1, False), (0, 2, False), (1, 3, True), (1, 4, False), (2, 4, True), (2, 5, False)
    ]  # fmt: skip
    assert steps[4].error == "MemoryError: fake device out of memory"
    assert [s.step for s in counted(steps, expected)] == [1, 2, 5]
    assert [s.step for s in counted(steps)] == [1, 2, 5]  # without run.json: the most common phase set


def test_a_run_without_a_step_after_the_first_is_refused(tmp_path):
    expected = record_run(tmp_path, range(1))
    with pytest.raises(ValueError, match="--steps >= 2"):
        analyse(read_jsonl(tmp_path / "phases.jsonl"), expected)


# -- the script ------------------------------------------------------------------------------------
def script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*BENCH, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_script_reads_recorded_runs_side_by_side(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    record_run(a, range(3))
    record_run(b, range(2), sample=True)
    r = script("--from-run", str(a), "--from-run", str(b), "--json", str(tmp_path / "out.json"))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "out.json").read_text())
    assert [x["label"] for x in out["runs"]] == ["fake-model fake (a)", "fake-model fake (b)"]
    assert [x["analysis"]["steps_counted"] for x in out["runs"]] == [[1, 2], [1]]
    assert out["runs"][0]["analysis"] == analyse(
        read_jsonl(a / "phases.jsonl"), step_phases(LifecycleOptions()), cadence=5
    )
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["bench"] == "step_cost" and len(last["runs"]) == 2
    share_table = r.stdout.split("\n\n")[0]
    for row in (
        "rollout",
        "train_step",
        "update_weights",
        "empty_cache#2",
        BETWEEN,
        "non-rollout, non-train_step",
    ):
        assert any(line.startswith(row + " ") for line in share_table.splitlines()), row
    assert "first step (compiles)" in r.stdout
    sec_table = r.stdout.split("\n\n")[1].splitlines()
    assert "GB/s" in next(x for x in sec_table if x.startswith("update_weights "))
    assert "GB/s" not in next(
        x for x in sec_table if x.startswith("release_rollout ")
    )  # frees, copies nothing


@pytest.mark.parametrize(
    "args, says",
    [
        (["--steps", "1"], "must be >= 2"),
        (["--backends", "mxnet"], "choose from jax, torch"),
        (["--save-every", "-1"], "must be >= 0"),
        (["--python-jax", "/nonexistent/python", "--backends", "jax"], "--python-jax"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args, says):
    r = script(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert says in r.stderr.strip().splitlines()[-1]


def test_bad_run_dirs_exit_2_naming_the_file(tmp_path):
    r = script("--from-run", str(tmp_path / "missing"))
    assert r.returncode == 2 and r.stderr.startswith("error:") and len(r.stderr.strip().splitlines()) == 1
    assert "missing/run.json: not found" in r.stderr
    record_run(tmp_path, range(1))
    r = script("--from-run", str(tmp_path))
    assert r.returncode == 2 and "--steps >= 2" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    (tmp_path / "phases.jsonl").write_text('{"phase": "rollout"}\n{}\n')
    r = script("--from-run", str(tmp_path))
    assert r.returncode == 2 and "phases.jsonl: record 1: missing key(s)" in r.stderr


@pytest.mark.slow
def test_script_on_real_tiny_runs_of_both_backends(tmp_path):
    """Two real runs (tiny, 3 steps, 2 prompts x 2 completions): every step phase measured on both."""
    if not (ROOT / ".venv-torch" / "bin" / "python").exists():
        pytest.skip("needs .venv-torch (make venv-torch) for the torch run")
    r = script("--models", "tiny", "--backends", "jax,torch", "--steps", "3", "--max-new-tokens", "4",
               "--runs-dir", str(tmp_path / "runs"), "--json", str(tmp_path / "out.json"), "--",
               "--prompts-per-step", "2", "--group-size", "2", timeout=1200)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    assert [x["label"] for x in out["runs"]] == ["tiny jax", "tiny torch"]
    for run in out["runs"]:
        a = run["analysis"]
        assert a["steps_counted"] == [1, 2]
        by = {p["phase"]: p for p in a["phases"]}
        assert set(by) == {*step_phases(LifecycleOptions()), "empty_cache#2", BETWEEN}
        assert all(p["seconds_median"] >= 0 for p in a["phases"])
        assert by["rollout"]["seconds_median"] > 0 and by["train_step"]["seconds_median"] > 0
        assert 0 < a["other_share_median"] < 1 and a["checkpoints_saved"] == 2  # --save-every 1
        assert by["update_weights"]["bytes_median"] > 0 and a["update"]["install_s_median"] > 0
        assert (Path(run["run_dir"]) / "phases.jsonl").exists()
        assert run["load_avg_1m_before"] is not None
        base = run["copy_baseline"]  # measured after the run, in its interpreter
        assert (
            base["runtime"] == run["backend"] and base["bytes"] == 64 * 2**20 and base["h2d"]["gbps_best"] > 0
        )
        ratio = by["update_weights"]["gbps_median"] / base["h2d"]["gbps_best"]
        assert run["update_gbps_over_h2d"] == pytest.approx(ratio, abs=1e-4)
        assert f"{run['label']}: update_weights at {run['update_gbps_over_h2d']:.3f}x the copy" in r.stdout

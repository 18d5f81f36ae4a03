"""``python -m mllm_rl.launch --nproc 2`` runs one torch RL run as two processes
(``backends/torch/distributed.py``: gloo on CPU, an embedded engine per process, the requests and
the micro-batches split between them; the trainer sharded with FSDP2 by default,
``backends/torch/fsdp.py``, or replicated with ``--fsdp 1``, gradients summed): the metrics of one
process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mllm_rl import hugepages
from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # engines in two processes, three runs

# with a bf16 checkpoint, the settings of a pretrained model: mixed precision, LoRA, lr 1e-6, T 0.7
RL = ["--backend", "torch", "--prompts-per-step", "8", "--group-size", "8", "--max-new-tokens", "8",
      "--micro-batch-size", "16", "--checkpoint-every", "1", "--wandb", "disabled", "--console", "off",
      "--lora-rank", "4", "--lr", "1e-6", "--temperature", "0.7"]  # fmt: skip


def run_env() -> dict[str, str]:
    """The tests' environment without the huge-page tunable the suite sets for forked runs: each
    launched ``python -m mllm_rl.run`` process asks for it itself (``mllm_rl/hugepages.py``)."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    return {**env, "MLLM_RL_DIST_TIMEOUT_S": "120", "PYTHONUNBUFFERED": "1"}


def launch(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = run_env()
    cmd = [sys.executable, "-m", "mllm_rl.launch", "--nproc", str(nproc), "--grace-s", "30", "--", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)


@pytest.fixture(scope="module")
def killed_and_resumed(tiny_bf16_ckpt, tmp_path_factory):
    """One two-process run (FSDP2, the default), process 1 SIGKILLed during step 1 (the checks of
    ``kill_process_1_in_step_1``), then ``--resume`` to the end: the run that the kill test and the
    data-parallel test both read."""
    from tests.launch_kill import kill_process_1_in_step_1

    run_dir = tmp_path_factory.mktemp("launch_killed") / "two"
    env = run_env()
    args = [*RL, "--model", str(tiny_bf16_ckpt), "--steps", "3", "--run-dir", str(run_dir)]
    kill_process_1_in_step_1([sys.executable, "-m", "mllm_rl.launch", "--nproc", "2", "--grace-s", "20", "--",
                              *args], env, run_dir)  # fmt: skip
    return launch(*args, "--resume"), run_dir


def resumed_attempt(recs: list[dict]) -> list[dict]:
    """The phase records of a run's last attempt (from its last ``wandb_init``)."""
    starts = [i for i, x in enumerate(recs) if x["phase"] == "wandb_init"]
    return recs[starts[-1] :]


def test_rl_as_two_data_parallel_processes_is_the_one_process_run(
    killed_and_resumed, tiny_bf16_ckpt, tmp_path
):
    """Each request sampled from its own seed by its index in the whole batch (which process
        generates it does not matter), every process with the whole batch, half of the micro-batches
        each and the gradient summed over both: step 0's rewards equal the one-process run's exactly,
        its loss and grad norm to float32 reduction noise. Later steps (a resume included) may differ
        by a sample or two: the embedded engine's bf16 logits depend on its sub-batch's shape (32 rows
        per process here, 64 in one), so a draw that lands within that noise of a token boundary can
        pick the neighbour token (seen: one of 64 samples at step 2, with the trainer's state after
        step 1 bit-identical in both runs). The trainer is sharded (FSDP2, the default over several
    processes): each process writes its shards of each checkpoint. The two-process run plans itself
    before start-up (``cpux2``), as one process does. The two-process run is the killed one, resumed
    from its step 0 checkpoint (``killed_and_resumed``): steps 1 and 2 are the resumed attempt's."""
    r, two = killed_and_resumed
    assert r.returncode == 0, r.stderr[-3000:]
    one = tmp_path / "one"
    r = launch(*RL, "--model", str(tiny_bf16_ckpt), "--steps", "3", "--run-dir", str(one), nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = {m["step"]: m for m in read_jsonl(one / "metrics.jsonl")}
    assert any(m["reward_mean"] > 0 for m in ref.values())  # a signal to compare, not all zeros
    for name in ("metrics.jsonl", "metrics.p1.jsonl"):
        got = {m["step"]: m for m in read_jsonl(two / name)}
        assert sorted(got) == [0, 1, 2], name
        assert got[0]["reward_mean"] == ref[0]["reward_mean"], name
        # bf16 compute over other micro-batch splits: within 1e-4 in earlier runs, up to 0.3% (loss)
        # and 1.6% (grad norm) apart on a 2-core host since (rewards still equal; not yet explained)
        assert got[0]["loss"] == pytest.approx(ref[0]["loss"], rel=5e-3, abs=1e-6), name
        assert got[0]["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=2.5e-2, abs=1e-6), name
        for s in (1, 2):  # at most two of the 64 samples (rewards in [0, 1]) drawn differently
            assert abs(got[s]["reward_mean"] - ref[s]["reward_mean"]) <= 2 / 64, (name, s)
    # the run planned itself for its two processes (FSDP2 over both), and held to the plan
    doc = json.loads((two / "plan.json").read_text())
    target = doc["plans"][doc["schedule"]]["target"]
    assert (target["name"], target["num_devices"]) == ("cpux2", 2), target
    assert "FSDP2 over 2 devices" in (two / "plan.txt").read_text()
    # both processes ran the same phases (the resumed attempt's: the kill cut the first one short)
    p0, p1 = (resumed_attempt(read_jsonl(two / name)) for name in ("phases.jsonl", "phases.p1.jsonl"))
    assert [x["phase"] for x in p0] == [x["phase"] for x in p1] and "train_step" in [x["phase"] for x in p0]
    step2 = two / "checkpoints" / "step_000002"  # FSDP (--fsdp 0, the default): each process its shards
    assert sorted(p.name for p in step2.iterdir()) == ["dcp", "meta.json"]
    assert sorted(p.name for p in (step2 / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def _train_step_bytes(run_dir, name: str = "phases.jsonl") -> int:
    """Device bytes in use at the end of the last ``train_step`` (params + AdamW state here)."""
    rec = [x for x in read_jsonl(run_dir / name) if x["phase"] == "train_step"][-1]
    return rec["memory"]["devices"][0]["bytes_in_use"]


def test_fsdp_full_fine_tune_shards_the_state_and_its_checkpoint_resumes_in_one_process(
    tiny_bf16_ckpt, tmp_path
):
    """A full fine-tune at a pretrained model's settings (bf16 checkpoint: float32 masters, bf16
    compute through FSDP2's mixed-precision policy; remat; lr 1e-6; T 0.7) on two processes, FSDP2
    (the default) against the same run on one process and on two unsharded (--fsdp 1), the three
    runs made by ``python -m mllm_rl.bench processes`` (its table, JSON and exit code checked too): step
    0's rewards equal, its loss and grad norm to float32 reduction noise; each FSDP process holds
    half the params and AdamW state (the shards of two processes are the whole, but for FSDP2's
    padding of a last shard), each to the byte what the torch planner traces for one rank of a fake
    process group; 64 rows in micro-batches of 24 make 3 micro-batches, so one process runs a
    weight-0 repeat to keep the collectives paired. The two-process checkpoint of step 0 (one
    shard file per process; the run's newest, step 1's, taken away) resumes in ONE process and its
    step 1 is the one-process run's step 1 exactly: torch.distributed.checkpoint reshards, and the
    restored masters and moments are bit for bit the one-process run's."""
    out, kept = tmp_path / "b.json", tmp_path / "runs"
    r = subprocess.run([sys.executable, "-m", "mllm_rl.bench", "processes", "--model", str(tiny_bf16_ckpt),
                        "--steps", "2", "--prompts-per-step", "8", "--group-size", "8", "--max-new-tokens", "8",
                        "--micro-batch-size", "24", "--json", str(out), "--keep", str(kept), "--",
                        "--checkpoint-every", "1", "--lora-rank", "0", "--lr", "1e-6", "--temperature", "0.7",
                        "--model-option", "remat=true"], capture_output=True, text=True, cwd=ROOT,
                       timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MEASURED" in r.stdout and "not a scaling figure" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [x["processes"] for x in rows] == [1, 2, 2]
    assert rows[1]["x_trainer_mib"] == pytest.approx(0.5, abs=0.01) and rows[2]["x_trainer_mib"] == 1.0
    assert rows[0]["reward0"] == rows[1]["reward0"] == rows[2]["reward0"]
    one, two, dp = kept / "one", kept / "two", kept / "dp"
    ref = {m["step"]: m for m in read_jsonl(one / "metrics.jsonl")}
    for run_dir in (two, dp):
        for name in ("metrics.jsonl", "metrics.p1.jsonl"):
            got = read_jsonl(run_dir / name)[0]
            assert got["reward_mean"] == ref[0]["reward_mean"], (run_dir.name, name)
            assert got["loss"] == pytest.approx(ref[0]["loss"], rel=5e-3, abs=1e-6), (run_dir.name, name)
            # bf16 gradients summed over other splits: up to 1.6% apart (see above)
            assert got["grad_norm"] == pytest.approx(ref[0]["grad_norm"], rel=2.5e-2), (run_dir.name, name)
    whole = _train_step_bytes(one)
    assert _train_step_bytes(dp) == _train_step_bytes(dp, "phases.p1.jsonl") == whole
    halves = [_train_step_bytes(two), _train_step_bytes(two, "phases.p1.jsonl")]
    assert whole <= sum(halves) <= whole * 1.02 and max(halves) <= whole * 0.52, (whole, halves)
    # the torch planner's trace of the same trainer, sharded over 2 ranks of torch's fake process
    # group (python -m mllm_rl.memplan --target h100x2 traces this): each process's state to the byte
    from mllm_rl.backends.torch import memplan
    from mllm_rl.presets import get_preset

    for world, measured in ((1, [whole]), (2, halves)):
        step = memplan.trainer_step_memory(get_preset("tiny"), 24, 64, 48, "bfloat16",
                                           options=(("remat", True),), device="cpu", world=world)  # fmt: skip
        assert all(step.params + step.optimizer == m for m in measured), (world, step, measured)
    assert sorted(p.name for p in (two / "checkpoints" / "step_000000" / "dcp").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp"]  # fmt: skip

    shutil.rmtree(two / "checkpoints" / "step_000001")  # step 0's checkpoint is the newest
    r = launch("--run-dir", str(two), "--resume", nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    steps = [m["step"] for m in read_jsonl(two / "metrics.jsonl")]
    assert steps == [0, 1, 1], steps  # step 1 again, from step 0's checkpoint
    got = {m["step"]: m for m in read_jsonl(two / "metrics.jsonl")}
    assert got[1]["reward_mean"] == ref[1]["reward_mean"]
    for k in ("loss", "grad_norm"):  # exact where step 0's update was (see above): else bf16 noise
        assert got[1][k] == pytest.approx(ref[1][k], rel=2.5e-2), k


def test_a_process_killed_mid_step_stops_the_sharded_run_and_resume_continues(killed_and_resumed):
    """FSDP2 (the default), process 1 SIGKILLed during step 1: the launcher stops process 0 and exits
    137 within a minute (process 0 does not wait out the collective's timeout), no process is
    left (both checked in ``killed_and_resumed``), and ``--resume`` continues both processes from
    the newest complete checkpoint (each process's shards through torch.distributed.checkpoint; a
    checkpoint cut short has no manifest and is skipped) to the end."""
    r, run_dir = killed_and_resumed
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("metrics.jsonl", "metrics.p1.jsonl"):
        assert [m["step"] for m in read_jsonl(run_dir / name)][-2:] == [1, 2], name
    # every process of both attempts started itself again with huge pages where the host has them
    asked = bool(hugepages.wanted({}, hugepages.thp_mode(), hugepages.glibc_version()))
    for name in ("phases.jsonl", "phases.p1.jsonl"):
        ready = [x["info"]["hugepages"] for x in read_jsonl(run_dir / name) if x["phase"] == "torch_ready"]
        assert len(ready) == 2 and all(h["glibc"] is asked for h in ready), (name, ready)


# a full fine-tune with a KL term (its reference forward runs on the shards, swapped in), LoRA
TRAINER_CFGS = {
    "full-kl-remat": {
        "lr": 1e-3,
        "micro_batch_size": 5,
        "loss": {"beta": 0.1},
        "model_options": [["remat", True]],
    },
    "lora-kl": {"lr": 1e-3, "micro_batch_size": 8, "lora_rank": 4, "loss": {"beta": 0.1}},
}


@pytest.fixture(scope="module")
def trainer_runs(tiny_bf16_ckpt, tmp_path_factory) -> dict[int, dict[str, dict]]:
    """``tests/fsdp_trainer_child.py`` on 1 and on 2 processes, each launch taking every config of
    ``TRAINER_CFGS`` in turn: {processes: {config id: its document}}."""
    import json

    tmp = tmp_path_factory.mktemp("fsdp_trainer")
    got = {}
    for n in (1, 2):
        out = tmp / f"{n}.json"
        cmd = [sys.executable, "-m", "mllm_rl.launch", "--nproc", str(n), "--module", "tests.fsdp_trainer_child",
               "--", str(tiny_bf16_ckpt), str(out), json.dumps(list(TRAINER_CFGS.values()))]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600,
                           env={**os.environ, "MLLM_RL_DIST_TIMEOUT_S": "120"})  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        got[n] = dict(zip(TRAINER_CFGS, json.loads(out.read_text()), strict=True))
    return got


@pytest.mark.parametrize("cfg", list(TRAINER_CFGS))
def test_the_sharded_trainer_takes_the_steps_of_the_unsharded_one(trainer_runs, cfg):
    """The trainer alone (``tests/fsdp_trainer_child.py``), one fixed batch of 24 rows, three steps
    with offload and onload between them, at a bf16 checkpoint's mixed precision: sharded over 2
    processes vs one process. Every step's loss, KL and grad norm agree to float32 reduction noise
    (the KL after the first step is not 0: the reference forward of the sharded trainer runs on the
    reference's shards, swapped into the params' own), and the engine export after the first step
    (gathered one tensor at a time) has the fingerprint of the one-process trainer's.
    24 rows in micro-batches of 5 are 5 micro-batches: process 1 runs a weight-0 repeat. The
    log-probs of the batch (each process computes its share of the micro-batches, all gathered)
    are the one process's."""
    got = {n: trainer_runs[n][cfg] for n in (1, 2)}
    assert got[2]["sharded"] and not got[1]["sharded"]
    one_lp, two_lp = np.array(got[1]["logprobs"]), np.array(got[2]["logprobs"])
    assert one_lp.shape == two_lp.shape == (24, 40) and (one_lp < 0).sum() > 400
    np.testing.assert_allclose(two_lp, one_lp, rtol=0, atol=1e-5)  # the processes' shares, gathered
    assert got[1]["steps"][1]["kl"] > 0
    for i, (one, two) in enumerate(zip(got[1]["steps"], got[2]["steps"], strict=True)):
        # by the third step two AdamW updates (each a gradient over a tiny second moment) have
        # amplified the reduction-order noise of the gradients into the params (seen: 1.1e-4 on the KL)
        rel = 1e-4 if i < 2 else 1e-3
        for k in ("loss", "kl", "grad_norm"):
            assert two[k] == pytest.approx(one[k], rel=rel, abs=1e-7), (i, k)
    for name, (s, sq) in got[1]["fingerprint"].items():
        assert got[2]["fingerprint"][name] == pytest.approx([s, sq], rel=1e-5, abs=1e-6), name

"""One run owns its run directory, and a resumed run is the run it continues.

Two runs started together on one directory: one is refused with exit 2 naming the holder, the other
finishes with an intact phase log. Resuming with a changed setting that defines the run is refused
until ``--override`` names it; ``run.json`` then records the change.

The runs are whole runs on the fake backend (``python -m tests.fake_run --backend fake``): the lock,
the preflight's resume checks, ``run.json`` and the checkpoint's ``meta.json`` are the core's, the
same for every backend; each backend's own checkpoints are resumed in tests/jax and tests/torch.
"""

from __future__ import annotations

import json
import time

import pytest

from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli, start_cli

RUN = ("tests.fake_run", "--backend", "fake")
SMALL = ["--steps", "2", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "4",
         "--max-running-requests", "8", "--checkpoint-every", "1", "--wandb", "disabled", "--console", "off"]  # fmt: skip


@pytest.mark.slow  # whole runs (on the fake backend)
def test_two_runs_on_one_directory_one_is_refused_the_other_is_intact(tiny_ckpt, tmp_path):
    """Two runs at once on one directory, then resumes of it: a changed --lr refused until
    --override names it, a checkpoint of another model shape refused before anything starts."""
    pytest.importorskip("transformers", reason="a run renders its prompts with the model's tokenizer")
    args = [*RUN, "--model", str(tiny_ckpt), "--run-dir", str(tmp_path), *SMALL]
    # a runtime that takes 1 s to come up: both runs are past the preflight (no phases.jsonl yet)
    # before either takes the lock, so only the lock can refuse one of them
    procs = [start_cli(*args, env={"MLLM_RL_NO_PROGRESS": "1", "FAKE_RUNTIME_UP_S": "1"}) for _ in range(2)]
    outs = [p.communicate(timeout=300)[1] for p in procs]
    codes = sorted(p.returncode for p in procs)
    assert codes == [0, 2], outs
    refused = outs[[p.returncode for p in procs].index(2)].strip().splitlines()
    assert len(refused) == 1, refused
    assert refused[0].startswith(f"error: --run-dir {tmp_path} ") and (
        "is in use by another run (pid " in refused[0] or "already holds a run (phases.jsonl)" in refused[0]
    )
    recs = read_jsonl(tmp_path / "phases.jsonl")
    assert [r["idx"] for r in recs] == list(range(len(recs)))  # one writer
    assert [r["phase"] for r in recs].count("wandb_init") == 1
    assert [r["step"] for r in recs if r["phase"] == "train_step"] == [0, 1]
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert [i for i in summary["issues"] if i["severity"] == "error"] == []

    # resumed with another learning rate: refused, nothing changed; then accepted with --override
    before = (tmp_path / "phases.jsonl").read_bytes(), (tmp_path / "run.json").read_bytes()
    resume = [*RUN, "--run-dir", str(tmp_path), "--resume", "--steps", "3",
              "--lr", "0.01", "--wandb", "disabled", "--console", "off"]  # fmt: skip
    r = run_cli(*resume, timeout=300)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--lr 0.01: " in r.stderr and "pass --override lr" in r.stderr
    assert ((tmp_path / "phases.jsonl").read_bytes(), (tmp_path / "run.json").read_bytes()) == before
    r = run_cli(*resume, "--override", "lr", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resume: --override lr: None -> 0.01 (recorded in run.json)" in r.stderr
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["overrides"] == [{"key": "lr", "from": None, "to": 0.01}]
    assert run["options"]["lr"] == 0.01 and run["train"]["lr"] == 0.01
    # not given on the command line: the run's own (--model, --group-size, --checkpoint-every)
    assert (
        run["options"]["model"] == str(tiny_ckpt) and run["group_size"] == 4 and run["checkpoint_every"] == 1
    )
    assert [r["step"] for r in read_jsonl(tmp_path / "phases.jsonl") if r["phase"] == "train_step"] == [
        0,
        1,
        2,
    ]
    assert (
        json.loads((tmp_path / "checkpoints" / "step_000002" / "meta.json").read_text())["model_shape"][
            "hidden_size"
        ]
        == ModelDir.open(tiny_ckpt).config.hidden_size
    )

    # a checkpoint of a model of another shape: refused before any engine starts, nothing written
    meta_path = tmp_path / "checkpoints" / "step_000002" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["model_shape"]["num_hidden_layers"] += 1
    meta_path.write_text(json.dumps(meta))
    before = (tmp_path / "phases.jsonl").read_bytes()
    r = run_cli(*RUN, "--run-dir", str(tmp_path), "--resume", "--steps", "4", "--wandb", "disabled",
                timeout=300)  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: {meta_path}: written for a model with num_hidden_layers")
    )
    assert (tmp_path / "phases.jsonl").read_bytes() == before


def test_the_preflight_finds_a_held_lock_without_taking_it(tmp_path):
    """``check_free`` reads /proc/locks: a held lock is busy (naming its holder), the lock file of a
    run that ended is not, and the peek never holds the lock (a run takes it right after)."""
    import fcntl
    import os

    from mllm_rl.run_files import RunDirBusy, acquire, check_free, lock_name

    check_free(tmp_path)  # no lock file
    held = open(tmp_path / lock_name(0), "a+")  # noqa: SIM115 -- closed below
    fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    held.write(json.dumps({"pid": os.getpid(), "host": "here", "run_id": "r1", "since": "now"}))
    held.flush()
    with pytest.raises(RunDirBusy, match=rf"in use by another run \(pid {os.getpid()} on here, run r1"):
        check_free(tmp_path)
    held.close()  # the run ended; its lock file stays, naming it
    check_free(tmp_path)
    (tmp_path / "sub").mkdir()
    acquire(tmp_path / "sub", 0, "r2")  # held by this process for its life (another directory)
    with pytest.raises(RunDirBusy, match="run r2"):
        check_free(tmp_path / "sub")
    check_free(tmp_path)
    with open(tmp_path / lock_name(0)) as f:  # nothing left held by the peeks
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


@pytest.mark.slow  # whole runs (on the fake backend)
def test_a_run_that_started_and_ended_while_another_came_up_is_not_appended_to(tiny_ckpt, tmp_path):
    """B passes the preflight on an empty directory, then its runtime comes up slowly; meanwhile A
    runs on the directory from start to end (the lock free again). B takes the lock and is refused:
    the directory holds A's run, checked again under the lock (B once appended to A's phase log)."""
    pytest.importorskip("transformers", reason="a run renders its prompts with the model's tokenizer")
    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    args = [*RUN, "--model", str(tiny_ckpt), "--run-dir", str(run_dir), *SMALL]
    b = start_cli(*args, env={"MLLM_RL_NO_PROGRESS": "1", "FAKE_RUNTIME_GATE": str(gate)})
    deadline = time.monotonic() + 120
    while not (tmp_path / "gate.up").exists() and b.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (tmp_path / "gate.up").exists(), b.communicate(timeout=60)[1][-3000:]
    a = run_cli(*args, env={"MLLM_RL_NO_PROGRESS": "1"}, timeout=300)
    assert a.returncode == 0, a.stderr[-3000:]
    before = (run_dir / "phases.jsonl").read_bytes()
    gate.touch()
    err = b.communicate(timeout=300)[1]
    assert b.returncode == 2 and err.strip().splitlines() == [
        f"error: --run-dir {run_dir} already holds a run (phases.jsonl); pass --resume to continue it "
        "or choose another --run-dir"
    ], err[-3000:]
    assert (run_dir / "phases.jsonl").read_bytes() == before

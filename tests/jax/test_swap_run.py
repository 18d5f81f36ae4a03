"""``python -m mllm_rl.run --backend jax --plan swap`` on a real sglang-jax engine (JAX CPU).

Each run is a subprocess: sglang-jax's ``shutdown()`` SIGKILLs every child of its process
and its scheduler thread aborts interpreter teardown, so it must never live in pytest's.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from mllm_rl.phases import validate_record
from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli, start_cli

PHASES = ["wandb_init", "jax_ready", "engine_ready_dummy", "weights_swapped", "generate_result"]
CHUNK_MB = 0.05  # every 2-D tiny tensor (192-256 KiB) goes through the chunked swap


def swap_run(run_dir: Path, model: Path, *extra: str, env: dict[str, str] | None = None):
    return run_cli(
        "mllm_rl.run", "--backend", "jax", "--plan", "swap", "--model", str(model),
        "--run-dir", str(run_dir), "--max-new-tokens", "8", "--quiet", *extra, env=env,
    )  # fmt: skip


def reference(model: Path, prompt_ids: list[list[int]], n: int):
    """Greedy tokens/logprobs of our flax nnx Qwen3 on the same checkpoint (independent of the engine)."""
    from mllm_rl.backends.jax.model import greedy_decode, load_qwen3
    from mllm_rl.checkpoint import ModelDir

    m = load_qwen3(ModelDir.open(model))
    return [greedy_decode(m, p, n) for p in prompt_ids]


@pytest.fixture(scope="module")
def tp1(tiny_ckpt, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tp1")
    return swap_run(run_dir, tiny_ckpt), run_dir


@pytest.mark.slow
def test_tp1_exits_clean_and_records_five_phases(tp1):
    r, run_dir = tp1
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr
    recs = read_jsonl(run_dir / "phases.jsonl")
    assert [x["phase"] for x in recs] == PHASES
    for x in recs:
        validate_record(x)
    dev = recs[3]["memory"]["devices"]
    assert len(dev) == 1 and dev[0]["source"] == "live_arrays" and dev[0]["platform"] == "cpu"
    assert recs[3]["info"]["fingerprint_ok"] is True and recs[3]["info"]["tensors"] == 25


@pytest.mark.slow
def test_tp1_swapped_engine_matches_reference_model(tp1, tiny_ckpt):
    _, run_dir = tp1
    gen = read_jsonl(run_dir / "phases.jsonl")[-1]["info"]
    ref = reference(tiny_ckpt, gen["prompt_ids"], 8)
    for (ref_toks, ref_lps), toks, lps in zip(ref, gen["token_ids"], gen["logprobs"], strict=True):
        assert toks == ref_toks
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 1e-3


@pytest.mark.slow
def test_tp1_streaming_peak_is_one_copy_plus_one_tensor_in_flight(tp1, tiny_ckpt):
    """Beyond the engine's weights, one tensor in flight: a kernel sent in HF layout and its
    transpose made on the device (two copies of it, the plan's staging), never a second model."""
    from mllm_rl.checkpoint import ModelDir

    _, run_dir = tp1
    swapped = read_jsonl(run_dir / "phases.jsonl")[3]["memory"]["devices"][0]
    largest = max(i.nbytes for _, i in ModelDir.open(tiny_ckpt).tensors.values())
    small_temporaries = 4096  # fingerprint scalars and the like
    in_flight = swapped["phase_peak_bytes"] - swapped["bytes_in_use"]
    assert largest <= in_flight <= 2 * largest + small_temporaries


@pytest.mark.slow
def test_tp1_wandb_offline_has_one_row_per_phase(tp1):
    from mllm_rl.sinks.wandb_file import read_history

    _, run_dir = tp1
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = [row for row in read_history(run_file) if "phase/name" in row]  # + one row of report tables
    assert [row["phase/name"] for row in rows] == PHASES
    assert all("mem/process/rss_bytes" in row for row in rows)
    assert "mem/jax/bytes_in_use_sum" in rows[3]


@pytest.mark.slow
def test_tp2_on_two_cpu_devices_with_a_chunked_swap_that_is_exact_and_peaks_at_one_chunk(tiny_ckpt, tmp_path):
    """Tensors above --swap-chunk-mb are written into the engine buffer slice by slice, each device's
    shard of them: the engine's weights are what was sent, its greedy tokens the reference model's,
    and no device holds more than one chunk on top of its weights (the chunked path on one device:
    ``test_a_chunked_swap_peaks_at_one_chunk_and_sigterm_then_ends_the_run_with_143``)."""
    r = swap_run(tmp_path, tiny_ckpt, "--tp", "2", "--wandb", "disabled", "--swap-chunk-mb", str(CHUNK_MB))
    assert r.returncode == 0, r.stderr[-3000:]
    recs = read_jsonl(tmp_path / "phases.jsonl")
    assert [x["phase"] for x in recs] == PHASES
    devs = recs[3]["memory"]["devices"]
    assert [d["id"] for d in devs] == [0, 1]
    assert all(d["bytes_in_use"] > 0 for d in devs)
    assert recs[3]["info"]["fingerprint_ok"] is True
    assert all(d["phase_peak_bytes"] <= d["bytes_in_use"] + CHUNK_MB * 2**20 + 4096 for d in devs), devs
    gen = recs[-1]["info"]
    ref = reference(tiny_ckpt, gen["prompt_ids"], 8)
    assert gen["token_ids"] == [t for t, _ in ref]


@pytest.mark.slow
def test_chunked_swap_that_does_nothing_fails_loudly(tiny_ckpt, tmp_path):
    r = swap_run(
        tmp_path,
        tiny_ckpt,
        "--swap-chunk-mb",
        str(CHUNK_MB),
        "--wandb",
        "disabled",
        env={"MLLM_RL_FAULTS": "swap_noop"},
    )
    assert r.returncode == 3 and "engine weights differ" in r.stderr


@pytest.mark.slow
def test_naive_swap_holds_two_copies(tiny_ckpt, tmp_path, tp1):
    r = swap_run(tmp_path, tiny_ckpt, "--swap-mode", "naive", "--wandb", "disabled")
    assert r.returncode == 0, r.stderr[-3000:]
    naive = read_jsonl(tmp_path / "phases.jsonl")[3]["memory"]["devices"][0]
    streaming = read_jsonl(tp1[1] / "phases.jsonl")[3]["memory"]["devices"][0]
    weights = read_jsonl(tmp_path / "phases.jsonl")[3]["info"]["bytes"]
    assert naive["phase_peak_bytes"] >= naive["bytes_in_use"] + weights
    assert naive["phase_peak_bytes"] > streaming["phase_peak_bytes"]


@pytest.mark.slow
def test_swap_that_does_nothing_fails_loudly(tiny_ckpt, tmp_path):
    """Fault injection: the engine drops every placed tensor instead of installing it."""
    r = swap_run(tmp_path, tiny_ckpt, "--wandb", "disabled", env={"MLLM_RL_FAULTS": "swap_noop"})
    assert r.returncode == 3
    assert "Traceback" not in r.stderr
    assert "error: weights_swapped: update_weights: engine weights differ from what was sent" in r.stderr
    recs = read_jsonl(tmp_path / "phases.jsonl")
    assert recs[-1]["phase"] == "weights_swapped" and "WeightMismatch" in recs[-1]["info"]["error"]


@pytest.mark.parametrize(
    "args,pattern",
    [
        (["--model", "/nonexistent/ckpt"], "not a directory"),
        (["--model", "qwen9-huge"], "not a preset"),
        (["--tp", "0"], "--tp must be >= 1"),
        (["--backend-x"], None),
    ],
)
def test_bad_arguments_exit_2_without_traceback(args, pattern, tmp_path):
    base = ["mllm_rl.run", "--backend", "jax", "--run-dir", str(tmp_path / "run"), "--wandb", "disabled"]
    r = run_cli(*base, *args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    if pattern:
        assert r.stderr.strip().count("\n") == 0 and pattern in r.stderr
        assert not (tmp_path / "run").exists()  # rejected before anything was started


def test_bad_checkpoint_rejected_before_engine(tiny_ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    (bad / "tokenizer.json").unlink()
    r = swap_run(tmp_path / "run", bad)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"error: {bad}/tokenizer.json: tokenizer file missing"
    assert not (tmp_path / "run").exists()


def test_tp_not_dividing_heads_is_rejected_before_engine(tiny_ckpt, tmp_path):
    r = swap_run(tmp_path, tiny_ckpt, "--tp", "3", "--wandb", "disabled")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "not divisible by --tp 3" in r.stderr
    assert list(tmp_path.iterdir()) == []  # refused before the run dir, W&B or the runtime


@pytest.mark.slow
def test_a_chunked_swap_peaks_at_one_chunk_and_sigterm_then_ends_the_run_with_143(tiny_ckpt, tmp_path):
    """On one device, tensors above --swap-chunk-mb go into the engine buffer slice by slice: the
    engine's weights are what was sent (fingerprint) and the peak is one chunk over the weights. Then
    SIGTERM during the long generation finishes the run: exit 143, the phase records it, W&B has
    every phase."""
    p = start_cli("mllm_rl.run", "--backend", "jax", "--plan", "swap", "--model", str(tiny_ckpt), "--run-dir",
                  str(tmp_path), "--max-new-tokens", "400", "--swap-chunk-mb", str(CHUNK_MB), "--quiet",
                  env={"MLLM_RL_NO_PROGRESS": "1", "WANDB_SILENT": "true"})  # fmt: skip
    phases = tmp_path / "phases.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if phases.exists() and len(read_jsonl(phases)) >= 4:  # weights swapped, generating now
            break
        time.sleep(0.2)
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143, err[-2000:]
    assert "Traceback" not in err and "BrokenPipe" not in err
    recs = read_jsonl(phases)
    assert [x["phase"] for x in recs] == PHASES
    assert recs[-1]["phase"] == "generate_result" and "Terminated" in recs[-1]["info"]["error"]
    assert recs[3]["info"]["fingerprint_ok"] is True and recs[3]["info"]["tensors"] == 25
    (dev,) = recs[3]["memory"]["devices"]
    assert dev["phase_peak_bytes"] <= dev["bytes_in_use"] + CHUNK_MB * 2**20 + 4096, dev
    from mllm_rl.sinks.wandb_file import read_history

    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert [r["phase/name"] for r in read_history(run_file) if "phase/name" in r] == [
        r["phase"] for r in recs
    ]
    assert json.loads((tmp_path / "run.json").read_text())["plan"] == "swap"

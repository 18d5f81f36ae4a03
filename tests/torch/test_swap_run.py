"""``python -m mllm_rl.run --backend torch --plan swap`` end to end (the embedded engine on CPU here).

Every run is a subprocess of the torch venv's interpreter, as a user would start it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mllm_rl.checkpoint import ModelDir
from mllm_rl.phases import validate_record
from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli

PHASES = ["wandb_init", "torch_ready", "engine_ready_dummy", "weights_swapped", "generate_result"]
SMALL_TEMPORARIES = 4096  # fingerprint accumulators and the like


def swap_run(
    run_dir: Path, model: Path, *extra: str, env: dict[str, str] | None = None, platform: str = "cpu"
):
    """A swap run; on CPU unless told (the CPU probe's numbers are what these tests check)."""
    return run_cli(
        "mllm_rl.run", "--backend", "torch", "--plan", "swap", "--model", str(model), "--platform", platform,
        "--run-dir", str(run_dir), "--max-new-tokens", "8", "--quiet", *extra, env=env,
    )  # fmt: skip


def largest_tensor(ckpt: Path) -> int:
    return max(i.nbytes for _, i in ModelDir.open(ckpt).tensors.values())


def have_wandb() -> bool:
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


@pytest.fixture(scope="module")
def streaming(tiny_ckpt, tmp_path_factory):
    """The default swap run (W&B offline; without the ``wandb`` extra installed, W&B disabled and
    only the W&B test skips)."""
    run_dir = tmp_path_factory.mktemp("torch_swap")
    return swap_run(run_dir, tiny_ckpt, *([] if have_wandb() else ["--wandb", "disabled"])), run_dir


@pytest.mark.slow
def test_exits_clean_and_records_five_schema_valid_phases(streaming):
    r, run_dir = streaming
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr
    recs = read_jsonl(run_dir / "phases.jsonl")
    assert [x["phase"] for x in recs] == PHASES
    for x in recs:
        validate_record(x)
        assert x["backend"] == "torch"
    ready = recs[1]["info"]
    import torch

    # --platform cpu on any host; the record says whether the host has CUDA (an H100 host does)
    assert (
        ready["platform"] == "cpu"
        and ready["torch_version"]
        and ready["cuda_available"] is torch.cuda.is_available()
    )
    assert recs[2]["info"]["engine"] == "EmbeddedEngine"
    dev = recs[3]["memory"]["devices"]
    assert len(dev) == 1 and dev[0]["source"] == "live_tensors" and dev[0]["platform"] == "cpu"
    assert recs[3]["info"]["fingerprint_ok"] is True and recs[3]["info"]["tensors"] == 25


@pytest.mark.slow
def test_swapped_engine_matches_the_hf_reference(streaming, hf_logits):
    from tests.engine_contract import reference_greedy

    gen = read_jsonl(streaming[1] / "phases.jsonl")[-1]["info"]
    for prompt, toks, lps in zip(gen["prompt_ids"], gen["token_ids"], gen["logprobs"], strict=True):
        ref_toks, ref_lps = reference_greedy(hf_logits, prompt, 8, eos=256)
        assert toks == ref_toks
        assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) < 1e-3


@pytest.mark.slow
def test_probe_sees_the_engine_and_the_streaming_peak_is_one_copy_plus_one_tensor(streaming, tiny_ckpt):
    recs = read_jsonl(streaming[1] / "phases.jsonl")
    ready, swapped = recs[2]["memory"]["devices"][0], recs[3]["memory"]["devices"][0]
    weights = recs[3]["info"]["bytes"]
    assert ready["bytes_in_use"] >= weights  # dummy weights + KV pool are live tensors
    assert swapped["bytes_in_use"] == ready["bytes_in_use"]  # in place: nothing added, nothing left behind
    # On CPU a staged slice of the same dtype is a view of the checkpoint's page cache: the
    # streaming swap allocates nothing the engine holds beyond its own weights.
    assert (
        swapped["phase_peak_bytes"] <= swapped["bytes_in_use"] + largest_tensor(tiny_ckpt) + SMALL_TEMPORARIES
    )


@pytest.mark.slow
def test_wandb_offline_has_one_row_per_phase(streaming):
    if not have_wandb():
        pytest.skip("needs wandb (the project's [wandb] extra)")
    from mllm_rl.sinks.wandb_file import read_history

    (run_file,) = streaming[1].glob("wandb/offline-run-*/run-*.wandb")
    rows = [row for row in read_history(run_file) if "phase/name" in row]  # + one row of report tables
    assert [row["phase/name"] for row in rows] == PHASES
    assert "mem/torch/bytes_in_use_sum" in rows[3]


@pytest.mark.slow
def test_naive_swap_holds_two_copies(tiny_ckpt, tmp_path, streaming):
    r = swap_run(tmp_path, tiny_ckpt, "--swap-mode", "naive", "--wandb", "disabled")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = read_jsonl(tmp_path / "phases.jsonl")
    naive, weights = recs[3]["memory"]["devices"][0], recs[3]["info"]["bytes"]
    stream = read_jsonl(streaming[1] / "phases.jsonl")[3]["memory"]["devices"][0]
    assert recs[3]["info"]["fingerprint_ok"] is True
    assert naive["phase_peak_bytes"] >= naive["bytes_in_use"] + weights
    assert naive["phase_peak_bytes"] > stream["phase_peak_bytes"]
    assert recs[-1]["info"]["token_ids"] == read_jsonl(streaming[1] / "phases.jsonl")[-1]["info"]["token_ids"]


@pytest.mark.slow
def test_chunked_streaming_swap_is_exact(tiny_ckpt, tmp_path, streaming):
    r = swap_run(tmp_path, tiny_ckpt, "--swap-chunk-mb", "0.05", "--wandb", "disabled")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = read_jsonl(tmp_path / "phases.jsonl")
    assert recs[3]["info"]["fingerprint_ok"] is True
    assert recs[-1]["info"]["token_ids"] == read_jsonl(streaming[1] / "phases.jsonl")[-1]["info"]["token_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("chunk", ["0", "0.05"])
def test_swap_that_does_nothing_fails_loudly(tiny_ckpt, tmp_path, chunk):
    """Fault injection: the engine stages and fingerprints every tensor but never installs it."""
    r = swap_run(tmp_path, tiny_ckpt, "--wandb", "disabled", "--swap-chunk-mb", chunk,
                 env={"MLLM_RL_FAULTS": "swap_noop"})  # fmt: skip
    assert r.returncode == 3, r.stderr[-2000:]
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
        (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_nothing_started(args, pattern, tmp_path):
    r = run_cli("mllm_rl.run", "--backend", "torch", "--plan", "swap", "--run-dir", str(tmp_path / "run"),
                "--wandb", "disabled", *args)  # fmt: skip
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and pattern in r.stderr
    assert not (tmp_path / "run").exists()


def test_bad_checkpoint_rejected_before_the_engine(tiny_ckpt, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    (bad / "config.json").write_text("{not json")
    r = swap_run(tmp_path / "run", bad)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().startswith(f"error: {bad}/config.json: invalid JSON")
    assert not (tmp_path / "run").exists()


def test_tp_2_is_refused_before_the_engine(tiny_ckpt, tmp_path):
    r = swap_run(tmp_path, tiny_ckpt, "--tp", "2", "--wandb", "disabled")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "embedded torch engine runs on one device" in r.stderr
    assert list(tmp_path.iterdir()) == []  # refused once the runtime is up, before the run dir


def test_engine_sglang_is_refused_before_the_engine_where_it_cannot_run(tiny_ckpt, tmp_path):
    r = swap_run(tmp_path, tiny_ckpt, "--engine", "sglang", "--wandb", "disabled")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "engine 'sglang' needs the sglang package and a CUDA device" in r.stderr
    assert list(tmp_path.iterdir()) == []  # refused once the runtime is up, before the run dir


def test_platform_cuda_without_cuda_is_a_clear_error(tiny_ckpt, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    r = swap_run(tmp_path, tiny_ckpt, "--wandb", "disabled", platform="cuda")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--platform gpu: torch" in r.stderr and "sees no CUDA device" in r.stderr
    assert list(tmp_path.iterdir()) == []  # refused once the runtime is up, before the run dir


@pytest.mark.slow
def test_cuda_swap_records_driver_truth_and_allocator_peaks(tiny_ckpt, tmp_path, streaming):
    from tests.torch.conftest import needs_cuda

    needs_cuda()
    r = swap_run(tmp_path, tiny_ckpt, "--wandb", "disabled", platform="cuda")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = read_jsonl(tmp_path / "phases.jsonl")
    assert recs[1]["info"]["platform"] == "cuda"
    devs = recs[3]["memory"]["devices"]
    assert [(d["id"], d["source"]) for d in devs[:2]] == [(0, "mem_get_info"), (0, "torch_allocator")]
    alloc = devs[1]
    assert alloc["phase_peak_bytes"] <= alloc["bytes_in_use"] + largest_tensor(tiny_ckpt) + 2 * 2**20
    assert recs[-1]["info"]["token_ids"] == read_jsonl(streaming[1] / "phases.jsonl")[-1]["info"]["token_ids"]

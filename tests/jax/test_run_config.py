"""The plan's knobs are the run's: ``--model-option``, ``--trainer-tp`` and ``--mem-fraction-static``
reach the trainer and the engine of a real run (JAX CPU), and run.json records them."""

from __future__ import annotations

import json
import math

import pytest

from mllm_rl.backends.jax.options import ModelOptions
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.options.check import parse_key_value
from mllm_rl.sinks.jsonl import read_jsonl
from tests.conftest import run_cli

# Both engine runs of this file: micro-batch 3 on one and on two devices (data axis 2), each with the
# plan's knobs set (AdamW moments in bfloat16, per-block remat, trainer tp 1, mem_fraction_static 0.5)
KNOBS = ["--model-option", "opt_dtype=bfloat16", "--model-option", "remat=block", "--trainer-tp", "1",
         "--mem-fraction-static", "0.5"]  # fmt: skip
MICRO = ["--steps", "2", "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "4",
         "--micro-batch-size", "3", "--checkpoint-every", "0", "--wandb", "disabled", "--quiet"]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tiny_ckpt, tmp_path_factory):
    """{engine tp: (completed process, run dir)}"""
    out = {}
    for tp in (1, 2):
        run_dir = tmp_path_factory.mktemp(f"tp{tp}")
        r = run_cli("mllm_rl.run", "--backend", "jax", "--model", str(tiny_ckpt), "--tp", str(tp), "--run-dir",
                    str(run_dir), *KNOBS, *MICRO, timeout=600)  # fmt: skip
        out[tp] = (r, run_dir)
    return out


@pytest.mark.slow  # starts an engine
def test_model_options_reach_the_trainer(tiny_ckpt, runs):
    """AdamW moments in bfloat16 (``opt_dtype``) over float32 params: 2 + 2 bytes of optimizer state per
    parameter, where the default (float32 moments) is 8."""
    n = sum(math.prod(info.shape) for _, info in ModelDir.open(tiny_ckpt).tensors.values())
    for tp, (r, run_dir) in runs.items():
        assert r.returncode == 0, r.stderr[-3000:]
        (init,) = [x for x in read_jsonl(run_dir / "phases.jsonl") if x["phase"] == "trainer_init"]
        state = init["info"]["state_bytes"]
        if tp == 1:  # one device holds it all
            assert state["params"] / n == pytest.approx(4, rel=0.01)
        assert state["optimizer"] == pytest.approx(state["params"], rel=0.01), tp
        options = json.loads((run_dir / "run.json").read_text())["options"]
        assert options["model_option"] == ["opt_dtype=bfloat16", "remat=block"]
        assert options["mem_fraction_static"] == 0.5 and options["trainer_tp"] == 1


def test_the_default_model_path_is_the_tpu_one_with_portable_attention():
    """Stacked layers, per-block remat and the chunked head on every platform; splash only on TPU;
    the loop / no-remat / whole-logits path by ``--model-option`` (``remat=none`` parses as None)."""
    for platform in ("cpu", "gpu", "tpu"):
        o = ModelOptions.for_platform(platform)
        assert (o.scan_layers, o.remat, o.logprob_chunk) == (True, "block", 256), platform
        assert (o.attention == "splash") == (platform == "tpu"), platform
    assert ModelOptions() == ModelOptions.for_platform("cpu")
    flags = ("scan_layers=false", "remat=none", "logprob_chunk=0")
    off = ModelOptions.for_run("cpu", options=dict(parse_key_value(f, "--model-option") for f in flags))
    assert (off.scan_layers, off.remat, off.logprob_chunk) == (False, "none", 0)


@pytest.mark.slow  # two runs
def test_a_micro_batch_padded_to_the_data_axis_trains_as_on_one_device(runs):
    """Micro-batch 3 on two devices (data axis 2) is padded to 4 rows, split over both: the recomputed
    old log-probs, the loss and the gradient are those of the same run on one device."""
    got = {}
    for tp, (r, run_dir) in runs.items():
        assert r.returncode == 0, r.stderr[-3000:]
        got[tp] = read_jsonl(run_dir / "metrics.jsonl")
    assert any(m["reward_mean"] > 0 for m in got[1])
    for one, two in zip(got[1], got[2], strict=True):
        assert two["reward_mean"] == one["reward_mean"]
        assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
        assert abs(two["loss"] - one["loss"]) < 1e-5
        assert abs(two["logp_mismatch_mean"] - one["logp_mismatch_mean"]) < 1e-5

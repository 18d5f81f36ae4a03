"""Which sglang-jax attention backend the engine runs on each device, and why.

sglang-jax's default ``fa`` (ragged paged attention, a Pallas TPU kernel) takes its block sizes
from a table that knows TPU v5, v6 and v7 and raises ``NotImplementedError`` for any other
version; it does not lower on GPU. The engine therefore runs ``native`` on CPU, GPU and TPU v4
(the project's first TPU target), ``fa`` on v5e/v5p/v6e/v7. The device kinds are what libtpu and
XLA's GPU target configs report (``topologies.DEVICE_KINDS``, held against the compilers in
``test_run_plan_target.py``)."""

from __future__ import annotations

import importlib.util
import re

import pytest

from mllm_rl.backends.jax import topologies
from mllm_rl.backends.jax.engine_layout import attention_backend, tpu_version


@pytest.mark.parametrize(
    "platform, kind, version, backend",
    [
        ("tpu", topologies.DEVICE_KINDS["v4"], 4, "native"),
        ("tpu", topologies.DEVICE_KINDS["v5e"], 5, "fa"),
        ("tpu", topologies.DEVICE_KINDS["v5p"], 5, "fa"),
        ("tpu", topologies.DEVICE_KINDS["v6e"], 6, "fa"),
        ("tpu", "TPU7x", 7, "fa"),
        ("tpu", "TPU v3", 3, "native"),
        ("gpu", topologies.DEVICE_KINDS["h100"], None, "native"),
        ("gpu", "NVIDIA H200", None, "native"),
        ("cpu", "cpu", None, "native"),
    ],
)
def test_attention_backend_per_device(platform, kind, version, backend):
    assert tpu_version(kind) == version
    assert attention_backend(platform, kind) == backend


def test_fa_is_chosen_only_where_sglang_jax_has_block_sizes():
    """The versions we send to ``fa`` are the ones sglang-jax's default block-size table handles
    (read from its source, so a new sglang-jax that drops or adds a version fails here)."""
    spec = importlib.util.find_spec("sgl_jax.srt.kernels.ragged_paged_attention.ragged_paged_attention_v3")
    if spec is None or spec.origin is None:
        pytest.skip("needs sglang-jax")
    src = open(spec.origin).read()
    body = src[src.index("def get_default_block_sizes") :]
    body = body[: body.index("\ndef ", 1)]
    cases = re.findall(r"^\s+case ([\d |]+):", body, re.M)  # "case 5 | 6:", "case 7:"
    handled = {int(v) for c in cases for v in c.split("|")}
    assert handled, "get_default_block_sizes has no 'case N' for TPU versions"
    fa = {v for v in range(2, 10) if attention_backend("tpu", f"TPU v{v}") == "fa"}
    assert fa <= handled
    assert 4 not in handled  # v4 must run native: the reason for the choice


def test_a_gpu_image_cuda13_plugin_counts_as_the_gpu_compiler(monkeypatch):
    seen = []

    def find_spec(name):
        seen.append(name)
        return object() if name == "jax_cuda13_plugin" else None

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert topologies._plugin_importable(topologies.spec("h200x1"))
    assert not topologies._plugin_importable(topologies.spec("v4-8"))


ENGINE_FORWARD = r"""
import dataclasses, json, re, sys
from mllm_rl.backends.jax import topologies
spec = topologies.spec(sys.argv[1])
topologies.prepare(spec)
devs, target = topologies.devices(spec)
import jax
from sgl_jax.srt.model_executor import forward_batch_info as fbi
from sgl_jax.srt.utils import jax_utils
from mllm_rl.backends.jax import engine_compile as ec
from mllm_rl.backends.jax.engine_layout import attention_backend
from mllm_rl.presets import get_preset
model = dataclasses.replace(get_preset("tiny"), num_hidden_layers=4)
attn = attention_backend(target.platform, target.device_kind)
shape = ec.ForwardShape("decode", 8, 8, 8 * 64, 1024)
out = {"kind": target.device_kind, "attention": attn}
def extra(lowered):
    m = lowered.compile().memory_analysis()
    return int(m.peak_memory_in_bytes) - int(m.argument_size_in_bytes)
two = ec.lower(model, devs, 1, attn, shape, layers=2)
out["kernels"] = sorted(set(re.findall(r'kernel_name = "([^"]+)"', two.as_text())))  # Pallas kernels
out["extra_2"] = extra(two)
if attn == "native":
    out["extra_4"] = extra(ec.lower(model, devs, 1, attn, shape))
    try:
        ec.lower(model, devs, 1, "fa", shape, layers=1)  # traced as a v4
        out["fa"] = "lowered"
    except NotImplementedError as e:
        out["fa"] = str(e)
else:
    out["extra_wide"] = extra(ec.lower(model, devs, 1, attn, dataclasses.replace(shape, cache_locs=8 * 256), layers=2))
out["restored"] = jax.devices()[0].platform == "cpu" and fbi.device_array is jax_utils.device_array
print(json.dumps(out))
"""


@pytest.mark.slow  # libtpu loaded in a fresh process per target
@pytest.mark.parametrize("name", ["v4-8", "v5e-8"])
def test_the_engine_forward_compiles_for_the_target_with_its_attention(name):
    """sglang-jax's decode forward lowered as the target (``engine_compile``) and compiled by
    libtpu: on v5e with its Pallas ``fa`` kernel (ragged paged attention, its kernels named RPA*), on v4 with
    ``native`` (whose only Pallas kernel on a TPU is the KV cache update; ``fa`` traced as a v4 raises
    sglang-jax's NotImplementedError). A forward's
    extra bytes are the same for 2 layers as for all 4 (within 1%: why a plan compiles 2), and for
    ``fa`` the same at 64 KV slots per request as at 256 (within 1%: why a plan caps them); the trace leaves
    ``jax.devices()`` and sglang-jax's ``device_array`` as they were."""
    import json
    import subprocess
    import sys

    from tests.conftest import ROOT, needs_libtpu

    needs_libtpu()
    r = subprocess.run(
        [sys.executable, "-c", ENGINE_FORWARD, name], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["kind"] == topologies.DEVICE_KINDS[name.split("-")[0]]
    assert out["restored"] is True
    assert out["extra_2"] > 0
    if name == "v4-8":
        assert (out["attention"], out["kernels"]) == ("native", ["kv_cache_update_kernel"])
        assert abs(out["extra_4"] - out["extra_2"]) <= 0.01 * out["extra_2"]  # layouts differ by bytes
        assert out["fa"] == "Unsupported tpu_version=4.", out["fa"]
    else:
        assert out["attention"] == "fa"
        assert out["kernels"] and all(k.startswith("RPA") for k in out["kernels"]), out["kernels"]
        assert abs(out["extra_wide"] - out["extra_2"]) <= 0.01 * out["extra_2"]

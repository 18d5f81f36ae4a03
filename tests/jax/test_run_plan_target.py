"""A run plans itself for the devices it came up on: on a TPU slice or an NVIDIA node, the target
whose device kind, count and hosts are the run's, compiled in a fresh process.

This machine has no TPU or GPU: the runtimes below are fakes of what ``JaxBackend.init_runtime``
reports there (platform, device kind, device count, process count). Ours is the rest of the
contract: the device kinds our table matches are the ones libtpu and XLA's GPU target configs give
their devices, the run's request is planned by ``mllm_rl.memplan.for_run`` with the target's real
compiler, and a configuration that cannot fit is refused naming its phase and component.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mllm_rl.backends.jax import topologies
from mllm_rl.memplan.audit import _device_bytes, measured_components
from mllm_rl.memplan.for_run import DoesNotFit, plan_run, target_for
from mllm_rl.memplan.request import PlanRequest
from mllm_rl.presets import get_preset
from tests.conftest import ROOT, needs_libtpu

KIND = """
import json, sys
from mllm_rl.backends.jax import topologies as T
s = T.spec(sys.argv[1]); T.prepare(s)
devs, target = T.devices(s)
print(json.dumps([devs[0].device_kind, len(devs), target.num_hosts]))
"""


@pytest.mark.parametrize("name", ["v4-8", "v4-16", "v5e-8", "v5p-8", "v6e-8", "h100x8", "h200x1"])
def test_the_device_kinds_we_match_are_the_compilers(name):
    """``topologies.shape`` (kind, devices, hosts from the spec, nothing loaded) against the
    compile-only devices libtpu / the CUDA plugin make for the target, one process each."""
    needs_libtpu()
    r = subprocess.run(
        [sys.executable, "-c", KIND, name], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    kind, n, hosts = json.loads(r.stdout.strip().splitlines()[-1])
    want_kind, want_n, want_hosts = topologies.shape(topologies.spec(name))
    assert (n, hosts) == (want_n, want_hosts)
    assert kind.startswith(want_kind) if name.startswith("h") else kind == want_kind


def test_a_runtime_maps_to_its_target():
    tpu = {"platform": "tpu", "device_kind": "TPU v4", "global_device_count": 4, "process_count": 1}
    assert target_for("jax", tpu) == "v4-8"
    assert target_for("jax", {**tpu, "global_device_count": 8, "process_count": 2}) == "v4-16"
    assert target_for("jax", {**tpu, "global_device_count": 8, "process_count": 1}) is None  # no such slice
    assert target_for("jax", {**tpu, "device_kind": "TPU v5 lite", "global_device_count": 8}) == "v5e-8"
    gpu = {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "global_device_count": 8}
    assert target_for("jax", gpu) == "h100x8"
    assert target_for("jax", {**gpu, "device_kind": "NVIDIA H200", "global_device_count": 1}) == "h200x1"
    assert target_for("jax", {**gpu, "device_kind": "NVIDIA H100 PCIe"}) is None
    assert target_for("jax", {"platform": "cpu", "process_count": 2}) is None
    assert target_for("jax", {"platform": "tpu"}) is None  # an older runtime record without the kind


def _v4_8_request(**kw) -> PlanRequest:
    return PlanRequest(
        backend="jax",
        target="v4-8",
        model=get_preset("tiny"),
        micro_batch=4,
        seq_len=64,
        tp=2,
        prompts=2,
        group_size=4,
        **kw,  # a rollout of 8 x 64 tokens: the engine's prefill compiles in seconds
    )


@pytest.mark.slow  # two plans compiled by libtpu, each in its own process
def test_a_tpu_run_is_planned_in_a_fresh_process_and_refused_when_it_cannot_fit():
    needs_libtpu()
    plan = plan_run(_v4_8_request(kv_tokens=4096, host_ram_gib=64.0), check_weights=False, fit_kv=False)
    doc = plan.doc["plans"]["multi_stage"]
    assert doc["target"]["name"] == "v4-8" and doc["target"]["device_kind"] == "TPU v4"
    assert plan.doc["for_run"] is True and plan.kv_tokens == 4096 and doc["fits"]
    assert doc["host"]["ram_bytes"] == 64 * 2**30 and "fits" in plan.host
    with pytest.raises(
        DoesNotFit, match=r"memory plan \(v4-8, predicted\): multi_stage: DOES NOT FIT: kv_pool"
    ):
        plan_run(_v4_8_request(kv_tokens=10**9, engine_forward="estimate"), check_weights=False, fit_kv=False)


def _record(phase: str, devices: list[int], **info) -> dict:
    mem = {"devices": [{"id": i, "bytes_in_use": b} for i, b in enumerate(devices)]}
    return {"phase": phase, "step": None, "memory": mem, "info": info}


def test_a_run_over_several_devices_is_held_by_its_fullest_device():
    assert _device_bytes(_record("rollout", [10, 30, 20, 30])) == 30
    recs = [
        _record("release_rollout", [0] * 4, held={"weights": 400, "kv_cache": 800}),
        _record("trainer_init", [0] * 4, state_bytes={"params": 40, "optimizer": 80}),
    ]
    assert measured_components(recs) == {
        "engine_weights": 100,
        "kv_pool": 200,
        "trainer_params": 10,
        "optimizer": 20,
    }

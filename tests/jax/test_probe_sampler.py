"""The JAX CPU probe counts live arrays; the recorder's sampler thread scans them while a phase
runs. A scan in flight holds a reference to every array it listed, so a phase-end snapshot taken
meanwhile would count arrays the code had already dropped (seen as memory the plan does not know
of on a loaded machine). The recorder never snapshots while a sample is in flight."""

from __future__ import annotations

import threading
import time

import jax
import jax.numpy as jnp

from mllm_rl.backends.jax import probe as jax_probe
from mllm_rl.phases import PhaseRecorder
from mllm_rl.phases.recorder import SAMPLER_THREAD


def test_a_phase_end_snapshot_does_not_count_arrays_a_slow_sample_still_holds(monkeypatch):
    real = jax.live_arrays
    scanning = threading.Event()

    def slow_in_the_sampler():
        arrays = real()
        if threading.current_thread().name == SAMPLER_THREAD:
            scanning.set()
            time.sleep(0.5)  # a scan descheduled mid-way, as on a busy 2-core host
        return arrays

    monkeypatch.setattr(jax_probe.jax, "live_arrays", slow_in_the_sampler)
    rec = PhaseRecorder("r", "jax", sample_interval_s=0.01)
    rec.set_probe(jax_probe.JaxMemoryProbe())
    dropped = 4 * 2**20
    try:
        with rec.phase("work"):
            x = jax.device_put(jnp.ones(dropped // 4, jnp.float32))
            x.block_until_ready()
            assert scanning.wait(5), "the sampler thread never scanned"
            scanning.clear()
            assert scanning.wait(5)  # a scan that listed x is in flight
            del x
        rec_end = rec.records[-1]
    finally:
        rec.close()
    devices = rec_end["memory"]["devices"]
    start = sum(d["bytes_in_use_start"] for d in devices)
    end = sum(d["bytes_in_use"] for d in devices)
    assert end - start < dropped, (start, end)

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


class _Buffer:
    """A fake of one shard's buffer as JAX 0.11 CPU has it while the step that defines it runs:
    ``unsafe_buffer_pointer()`` would block until it is defined, holding the GIL (the sampler
    thread then deadlocked against ``train_step``'s ``device_get``)."""

    def __init__(self, nbytes: int, ready: bool, ptr: int) -> None:
        self.nbytes, self.ready, self.ptr = nbytes, ready, ptr

    def is_ready(self) -> bool:
        return self.ready

    def unsafe_buffer_pointer(self) -> int:
        if not self.ready:
            raise AssertionError("unsafe_buffer_pointer() of a pending buffer: blocks holding the GIL")
        return self.ptr


class _Array:
    def __init__(self, device, data: _Buffer) -> None:
        self.data, self.device = data, device
        self.sharding = type("S", (), {"memory_kind": "device"})()
        self.addressable_shards = [self]

    def is_deleted(self) -> bool:
        return False


def test_the_scan_never_asks_a_pending_buffer_for_its_pointer_and_still_counts_it(monkeypatch):
    dev = jax.devices()[0]
    ready, alias = _Buffer(100, True, 7), _Buffer(100, True, 7)  # two Arrays of one buffer
    pending = _Buffer(1000, False, 0)
    arrays = [_Array(dev, ready), _Array(dev, alias), _Array(dev, pending)]
    monkeypatch.setattr(jax_probe.jax, "live_arrays", lambda: arrays)
    assert jax_probe.live_array_bytes([dev]) == [1100]


class _Counted:
    """A fake Array that counts how often its shards are listed (a Python object per shard)."""

    def __init__(self, device, data: _Buffer) -> None:
        self.data, self.device, self.deleted, self.listed = data, device, False, 0
        self.sharding = type("S", (), {"memory_kind": "device"})()

    @property
    def addressable_shards(self) -> list:
        self.listed += 1
        return [self]

    def is_deleted(self) -> bool:
        return self.deleted


def test_a_scan_lists_a_ready_arrays_shards_once_and_forgets_it_when_freed(monkeypatch):
    """What a ready array holds is read once while it lives (later scans only ask whether it was
    deleted); a pending one is read again each scan until ready; a deleted one is not counted, a
    freed one forgotten (its id may name the next array)."""
    import gc

    dev = jax.devices()[0]
    ready, pending = _Counted(dev, _Buffer(100, True, 7)), _Counted(dev, _Buffer(1000, False, 0))
    arrays = [ready, pending]
    monkeypatch.setattr(jax_probe.jax, "live_arrays", lambda: list(arrays))
    assert [jax_probe.live_array_bytes([dev]) for _ in range(3)] == [[1100]] * 3
    assert (ready.listed, pending.listed) == (1, 3)
    pending.data.ready, pending.data.ptr = True, 8
    assert jax_probe.live_array_bytes([dev]) == [1100] and pending.listed == 4
    ready.deleted = True
    assert jax_probe.live_array_bytes([dev]) == [1000]
    key = id(ready)
    assert key in jax_probe._LAYOUTS
    arrays.remove(ready)
    del ready
    gc.collect()
    assert key not in jax_probe._LAYOUTS


def test_a_scan_during_a_running_computation_returns_at_once_and_counts_its_output():
    @jax.jit
    def slow(x):
        return jax.lax.fori_loop(0, 200, lambda i, x: jnp.tanh(x @ x), x)

    x = jnp.ones((512, 512), jnp.float32)
    slow(x).block_until_ready()
    before = jax_probe.live_array_bytes(jax.devices()[:1])[0]
    y = slow(x)
    t0 = time.perf_counter()
    during = jax_probe.live_array_bytes(jax.devices()[:1])[0]
    took = time.perf_counter() - t0
    pending = not y.is_ready()
    y.block_until_ready()
    assert during == before + y.nbytes
    if pending:  # the scan ran while the computation did: it did not wait for it
        assert took < 0.5 * (time.perf_counter() - t0) + 0.05


def test_a_phase_records_the_xla_compiles_made_in_it_in_any_thread():
    """``compiles`` / ``compile_s`` / ``compile_cache_hits`` in a phase's info: a new program
    compiled in the phase, in the phase's thread and in another (sglang-jax compiles in its own),
    is counted; a phase that runs only programs already compiled has no such keys. The programs
    hold a constant of this run: never in the persistent cache, so no compile is a cache hit."""
    rec = PhaseRecorder("r", "jax", sample_interval_s=10)
    rec.set_probe(jax_probe.JaxMemoryProbe())
    x, c = jnp.arange(7.0), float(time.time_ns() % 10**9)
    f = jax.jit(lambda a: a * 3.0 + c)
    g = jax.jit(lambda a: a - c)
    try:
        with rec.phase("compiles"):
            f(x).block_until_ready()
            t = threading.Thread(target=lambda: g(x).block_until_ready())
            t.start()
            t.join()
        with rec.phase("runs"):
            f(x).block_until_ready()
            g(x).block_until_ready()
    finally:
        rec.close()
    first, second = (r["info"] for r in rec.records)
    assert first["compiles"] == 2 and first["compile_s"] >= 0 and first["compile_cache_hits"] == 0, first
    assert "compiles" not in second, second

"""PhaseRecorder + sinks, with a scripted probe (a fake device we control)."""

from __future__ import annotations

import json

import pytest

from mllm_rl.phases import DeviceMemory, PhaseRecorder, SchemaError, validate_record
from mllm_rl.sinks.jsonl import JsonlSink, read_jsonl


class ScriptedProbe:
    """Two fake devices whose bytes in use the test sets directly."""

    def __init__(self) -> None:
        self.used = [100, 200]
        self.peak = [100, 200]

    def set(self, i: int, v: int) -> None:
        self.used[i] = v
        self.peak[i] = max(self.peak[i], v)

    def in_use(self):
        return list(self.used)

    def snapshot(self):
        return [
            DeviceMemory(i, "fake", u, self.peak[i], 1000, "memory_stats", {"bytes_in_use": u})
            for i, u in enumerate(self.used)
        ]


def test_records_are_schema_valid_and_in_order(tmp_path):
    probe = ScriptedProbe()
    rec = PhaseRecorder(
        "r1", "jax", sinks=[JsonlSink(tmp_path / "p.jsonl")], probe=probe, sample_interval_s=0
    )
    for i, name in enumerate(["a", "b", "c"]):
        with rec.phase(name, step=i, note=name) as ph:
            ph.info["extra"] = i
    rec.close()
    recs = read_jsonl(tmp_path / "p.jsonl")
    assert [r["phase"] for r in recs] == ["a", "b", "c"]
    assert [r["idx"] for r in recs] == [0, 1, 2]
    for i, r in enumerate(recs):
        validate_record(r)
        assert r["step"] == i and r["info"] == {"note": r["phase"], "extra": i}
        assert [d["id"] for d in r["memory"]["devices"]] == [0, 1]


def test_explicit_sample_catches_transient_peak():
    probe = ScriptedProbe()
    rec = PhaseRecorder("r", "jax", probe=probe, sample_interval_s=0)
    with rec.phase("swap"):
        probe.set(0, 900)  # transient: a second copy
        rec.sample()
        probe.set(0, 150)
    d0 = rec.records[0]["memory"]["devices"][0]
    assert d0["bytes_in_use_start"] == 100 and d0["bytes_in_use"] == 150
    assert d0["phase_peak_bytes"] == 900


def test_high_points_are_sampled_at_each_new_largest_in_flight_and_the_peak_is_kept():
    class Counting(ScriptedProbe):
        calls = 0

        def in_use(self):
            self.calls += 1
            return super().in_use()

    probe = Counting()
    rec = PhaseRecorder("r", "jax", probe=probe, sample_interval_s=0)
    with rec.phase("update_weights"):
        n0 = probe.calls
        for n in (300, 100, 300, 50, 400, 399):  # one tensor in flight at a time
            probe.set(0, 100 + n)
            rec.sample_high_point(n)
            probe.set(0, 100)
        sampled = probe.calls - n0
    assert sampled == 2  # 300 and 400: not the second 300 (a tie finds the same peak)
    assert rec.records[0]["memory"]["devices"][0]["phase_peak_bytes"] == 500
    with rec.phase("next"):  # a new phase starts from nothing in flight
        n0 = probe.calls
        rec.sample_high_point(1)
        assert probe.calls - n0 == 1


def test_cumulative_peak_rise_counts_even_unsampled():
    probe = ScriptedProbe()
    rec = PhaseRecorder("r", "jax", probe=probe, sample_interval_s=0)
    with rec.phase("p"):
        probe.set(1, 700)  # never sampled, but the allocator's cumulative peak rose
        probe.used[1] = 250
    assert rec.records[0]["memory"]["devices"][1]["phase_peak_bytes"] == 700
    with rec.phase("q"):  # peak did not rise in q: 700 must not leak into q
        pass
    assert rec.records[1]["memory"]["devices"][1]["phase_peak_bytes"] == 250


def test_sampler_thread_sees_peak_during_phase():
    import time

    probe = ScriptedProbe()
    probe.peak = [None, None]  # an allocator without cumulative peak: only sampling can see it
    probe.snapshot = lambda: [
        DeviceMemory(i, "fake", u, None, None, "live_arrays") for i, u in enumerate(probe.used)
    ]
    rec = PhaseRecorder("r", "jax", probe=probe, sample_interval_s=0.001)
    with rec.phase("p"):
        probe.used[0] = 5000
        time.sleep(0.1)
        probe.used[0] = 100
    rec.close()
    assert rec.records[0]["memory"]["devices"][0]["phase_peak_bytes"] == 5000


def test_failing_phase_is_recorded_with_error_and_reraises(tmp_path):
    rec = PhaseRecorder(
        "r", "jax", sinks=[JsonlSink(tmp_path / "p.jsonl")], probe=ScriptedProbe(), sample_interval_s=0
    )
    with pytest.raises(MemoryError):
        with rec.phase("train_step", step=1):
            raise MemoryError("RESOURCE_EXHAUSTED: 9.1G")
    (r,) = read_jsonl(tmp_path / "p.jsonl")
    assert r["phase"] == "train_step" and "MemoryError: RESOURCE_EXHAUSTED" in r["info"]["error"]
    assert r["memory"]["devices"][0]["bytes_in_use"] == 100


def test_nested_phase_is_refused():
    rec = PhaseRecorder("r", "jax", sample_interval_s=0)
    with pytest.raises(RuntimeError, match="inside another phase"):
        with rec.phase("a"):
            with rec.phase("b"):
                pass


def test_jsonl_torn_last_line_is_skipped(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"a": 1}) + "\n" + '{"b": ')
    assert read_jsonl(p) == [{"a": 1}]


def test_schema_rejects_zero_for_unknown_and_bad_source():
    rec = PhaseRecorder("r", "jax", probe=ScriptedProbe(), sample_interval_s=0)
    with rec.phase("a"):
        pass
    good = rec.records[0]
    validate_record(good)
    bad = json.loads(json.dumps(good))
    bad["memory"]["devices"][0]["source"] = "guess"
    with pytest.raises(SchemaError, match="source"):
        validate_record(bad)
    bad = json.loads(json.dumps(good))
    del bad["memory"]["host"]["rss_peak_bytes"]
    with pytest.raises(SchemaError, match="memory.host"):
        validate_record(bad)


def test_wandb_offline_one_row_per_phase(tmp_path):
    pytest.importorskip("wandb")
    from mllm_rl.sinks.wandb_file import read_history
    from mllm_rl.sinks.wandb_sink import WandbSink

    sink = WandbSink("offline", tmp_path, "wb-test")
    rec = PhaseRecorder("wb-test", "jax", sinks=[sink], probe=ScriptedProbe(), sample_interval_s=0)
    names = ["wandb_init", "jax_ready", "engine_ready_dummy"]
    for n in names:
        with rec.phase(n):
            pass
    rec.close(0)
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-wb-test.wandb")
    rows = read_history(run_file)
    assert [r["phase/name"] for r in rows] == names
    assert [r["phase/idx"] for r in rows] == [0, 1, 2]
    row = rows[0]
    assert row["mem/jax/bytes_in_use_sum"] == 300 and row["mem/jax/bytes_in_use_max"] == 200
    assert row["mem/jax/device1/bytes_in_use"] == 200
    assert "mem/process/rss_bytes" in row and "time/elapsed_s" in row


def test_phase_table_sums_devices_and_marks_errors():
    from mllm_rl.summary import phase_table

    probe = ScriptedProbe()
    rec = PhaseRecorder("r", "jax", probe=probe, sample_interval_s=0)
    with rec.phase("ok"):
        probe.set(0, 2**30)
    with pytest.raises(RuntimeError):
        with rec.phase("bad", step=2):
            raise RuntimeError("boom")
    lines = phase_table(rec.records).splitlines()
    assert lines[2].split()[0] == "ok" and lines[2].split()[4] == f"{(2**30 + 200) / 2**30:.3f}"
    assert lines[3].split()[:2] == ["bad", "2"] and "ERROR: RuntimeError: boom" in lines[3]


def test_phase_table_counts_each_device_once_when_two_sources_report_it():
    """CUDA records list a device twice (mem_get_info and torch_allocator): one of them is summed."""
    from mllm_rl.summary import phase_table

    def dev(source: str, used: int) -> dict:
        return {"id": 0, "platform": "gpu", "source": source, "bytes_in_use_start": used,
                "bytes_in_use": used, "phase_peak_bytes": used}  # fmt: skip

    rec = {"phase": "p", "step": None, "t_start": 0.0, "t_end": 1.0, "info": {},
           "memory": {"devices": [dev("mem_get_info", 3 * 2**30), dev("torch_allocator", 2**30)],
                      "host": {"rss_bytes": 0, "rss_peak_bytes": 0}}}  # fmt: skip
    assert phase_table([rec]).splitlines()[2].split()[3:6] == ["3.000", "3.000", "3.000"]


def test_close_stops_a_sampler_that_is_backing_off_after_a_slow_sample():
    """The sampler waits twice its last sample's time before the next one (at most a third of a
    core); ``close`` ends that wait, so the sampler is gone when ``close`` returns instead of
    outliving it (here a 2.4 s wait after a 1.2 s sample, past ``close``'s 2 s join)."""
    import threading
    import time

    from mllm_rl.phases.recorder import SAMPLER_THREAD

    class Slow(ScriptedProbe):
        sampled = threading.Event()

        def in_use(self):
            if threading.current_thread().name == SAMPLER_THREAD and not self.sampled.is_set():
                time.sleep(1.2)
                self.sampled.set()
            return super().in_use()

    probe = Slow()
    rec = PhaseRecorder("r", "jax", probe=probe, sample_interval_s=0.005)
    with rec.phase("p"):
        assert probe.sampled.wait(10)
    rec.close()
    assert not rec._thread.is_alive()

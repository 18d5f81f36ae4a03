"""Named fakes for the multi-task tests: a fake device, engine and trainer (things that stand in
for a real accelerator and real models), and a thread coordinator that plays several processes.

What runs for real on top of them is ours: ``Colocated``'s leased phase groups, ``ManagedEngine``,
``PhaseRecorder``, the lease schedule and the driver. Every fake primitive sleeps a random delay
(``FakeDevice.delay``), so thread interleavings differ from run to run.
"""

from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mllm_rl.engine import (
    TAG_KV,
    TAG_WEIGHTS,
    Fingerprint,
    GenerateOutput,
    SamplingParams,
    UpdateStats,
    WeightExport,
)
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.lifecycle import Colocated, LifecycleOptions, colocate, release_on_fault
from mllm_rl.multitask.driver import FINAL, ROLLOUT, SETUP, TRAIN, Lease
from mllm_rl.multitask.runtime import ENGINE_READY
from mllm_rl.phases import DeviceMemory, PhaseRecorder
from mllm_rl.trainer import OPTIMIZER, PARAMS, RolloutBatch, train_metrics

NAMES = ("layer.0.weight", "layer.1.weight")
SHAPE = (64, 32)  # float32: 8 KiB per tensor


def _fp(named: Iterable[tuple[str, np.ndarray]]) -> Fingerprint:
    return {
        n: (float(a.astype(np.float64).sum()), float((a.astype(np.float64) ** 2).sum())) for n, a in named
    }


class FakeDevice:
    """One fake accelerator: bytes per owner (a memory tag name such as ``a/weights``)."""

    def __init__(self, max_delay_s: float = 0.0, seed: int = 0) -> None:
        self.owned: dict[str, int] = defaultdict(int)
        self.max_delay_s = max_delay_s
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def delay(self) -> None:
        if self.max_delay_s > 0:
            with self.lock:
                d = self.rng.uniform(0, self.max_delay_s)
            time.sleep(d)

    def alloc(self, owner: str, n: int) -> None:
        with self.lock:
            self.owned[owner] += n

    def free(self, owner: str) -> int:
        with self.lock:
            return self.owned.pop(owner, 0)

    def total(self) -> int:
        with self.lock:
            return sum(self.owned.values())

    def of_task(self, task: str) -> int:
        with self.lock:
            return sum(v for k, v in self.owned.items() if k.startswith(task + "/"))


class FakeProbe:
    """``MemoryProbe`` over a ``FakeDevice`` (its total is the device truth of these tests)."""

    def __init__(self, dev: FakeDevice) -> None:
        self.dev = dev

    def in_use(self) -> list[int | None]:
        return [self.dev.total()]

    def snapshot(self) -> list[DeviceMemory]:
        t = self.dev.total()
        return [DeviceMemory(0, "fake", t, None, None, "live_arrays", {})]


class FakeEngine:
    """``EnginePrimitives`` on a ``FakeDevice``: weights are numpy arrays, tags named ``<task>/<tag>``."""

    tags = (TAG_WEIGHTS, TAG_KV)
    weights_cpu_backup = False
    KV_BYTES = 4096

    def __init__(self, dev: FakeDevice, task: str) -> None:
        self.dev, self.task = dev, task
        self.weights = {n: np.full(SHAPE, 1e-3, np.float32) for n in NAMES}  # dummy weights
        self.resident = {TAG_WEIGHTS: True, TAG_KV: True}
        dev.alloc(self.memory_tag(TAG_WEIGHTS), self.weight_bytes())
        dev.alloc(self.memory_tag(TAG_KV), self.KV_BYTES)

    def memory_tag(self, tag: str) -> str:
        return f"{self.task}/{tag}"

    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerateOutput]:
        self.dev.delay()
        w = sum(float(a.sum()) for a in self.weights.values())
        rng = np.random.default_rng([sampling.seed or 0, int(abs(w) * 1e3) % 2**31])
        outs = []
        for _ in input_ids:
            toks = [int(t) for t in rng.integers(1, 50, sampling.max_new_tokens)]
            outs.append(GenerateOutput(toks, [-1.0] * len(toks), "", "length"))
        return outs

    def weight_names(self) -> list[str]:
        return list(NAMES)

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], on_tensor: Any = None) -> UpdateStats:
        self.dev.delay()
        got = {}
        for name, arr in named_tensors:
            got[name] = np.array(arr, np.float32)
            self.weights[name] = got[name]
        return UpdateStats(len(got), sum(a.nbytes for a in got.values()), 1e-3, _fp(got.items()))

    def weights_fingerprint(self, names: Sequence[str] | None = None) -> Fingerprint:
        return _fp((n, self.weights[n]) for n in (self.weights if names is None else names))

    def weight_bytes(self) -> int:
        return sum(a.nbytes for a in self.weights.values())

    def tag_bytes(self, tag: str) -> int:
        return self.weight_bytes() if tag == TAG_WEIGHTS else self.KV_BYTES

    def release_memory(self, tag: str) -> None:
        self.dev.delay()
        self.dev.free(self.memory_tag(tag))
        self.resident[tag] = False
        if tag == TAG_WEIGHTS:  # no CPU backup: contents lost
            self.weights = {n: np.zeros(SHAPE, np.float32) for n in NAMES}

    def resume_memory(self, tag: str) -> bool:
        self.dev.delay()
        self.dev.alloc(self.memory_tag(tag), self.tag_bytes(tag))
        self.resident[tag] = True
        return tag != TAG_WEIGHTS

    def pause_generation(self) -> None:
        pass

    def continue_generation(self) -> None:
        pass

    def flush_cache(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


class FakeTrainer:
    """``Trainer`` on a ``FakeDevice``: numpy params, an optimizer state of the same size."""

    def __init__(
        self, dev: FakeDevice, task: str, seed: int, fail_at: int | None = None, nan_at: int | None = None
    ) -> None:
        self.dev, self.task, self.fail_at, self.nan_at = dev, task, fail_at, nan_at
        rng = np.random.default_rng(seed)
        self.params = {n: rng.standard_normal(SHAPE).astype(np.float32) * 0.02 for n in NAMES}
        self.onload([PARAMS, OPTIMIZER])
        self.steps = 0

    def _bytes(self) -> int:
        return sum(a.nbytes for a in self.params.values())

    def onload(self, what: Sequence[str]) -> int:
        self.dev.delay()
        n = 0
        for w in what:
            if not self.resident()[w]:
                self.dev.alloc(f"{self.task}/trainer_{w}", self._bytes())
                n += self._bytes()
        return n

    def offload(self, what: Sequence[str]) -> int:
        self.dev.delay()
        return sum(self.dev.free(f"{self.task}/trainer_{w}") for w in what)

    def resident(self) -> dict[str, bool]:
        return {k: self.dev.owned.get(f"{self.task}/trainer_{k}", 0) > 0 for k in (PARAMS, OPTIMIZER)}

    def state_bytes(self) -> dict[str, int]:
        return {PARAMS: self._bytes(), OPTIMIZER: self._bytes()}

    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        self.dev.delay()
        if self.fail_at == self.steps:  # params and optimizer state are on the device now
            raise RuntimeError(f"injected failure in {self.task} train step {self.steps}")
        g = float(batch.advantages.mean()) + 0.01
        for n in NAMES:
            self.params[n] = self.params[n] * (1 - 1e-3) + g * 1e-3
        if self.nan_at == self.steps:  # a broken reward / diverged step: the loss is NaN
            g = float("nan")
        self.steps += 1
        return train_metrics(g, 1, [abs(g)], {"tokens": float(batch.loss_mask.sum())}, 0.0)

    def logprobs(self, batch: RolloutBatch) -> np.ndarray:
        """The engine's log-probs (a trainer that agrees with the engine exactly)."""
        if not self.resident()[PARAMS]:
            raise RuntimeError(f"{self.task}: logprobs with params offloaded")
        return batch.old_logp.copy()

    def greedy(self, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        return [1] * n, [1.0] * n

    def export_weights(self, full: bool = True) -> WeightExport:
        return WeightExport.of([(n, self.params[n].copy()) for n in NAMES], full=True)

    def weights_fingerprint(self, names: Sequence[str] | None = None) -> Fingerprint:
        return _fp((n, self.params[n]) for n in (names or NAMES))

    def save(self, path: Path) -> None:
        np.savez(path / "params.npz", **self.params)

    def snapshot(
        self, path: Path | None = None
    ) -> None:  # multi-task runs write their checkpoints in the phase
        return None

    def restore(self, path: Path) -> None:
        with np.load(path / "params.npz") as z:
            self.params = {n: z[n] for n in NAMES}


class _Backend:
    name = "fake"

    def empty_cache(self) -> None:
        pass


def _rollout(engine: ManagedEngine, step: int | None) -> tuple[RolloutBatch, dict[str, Any]]:
    outs = engine.generate([[1, 2, 3]] * 4, SamplingParams(max_new_tokens=3, temperature=1.0, seed=step or 0))
    b, t = len(outs), 6
    tokens = np.zeros((b, t), np.int32)
    for i, o in enumerate(outs):
        tokens[i, :3] = [1, 2, 3]
        tokens[i, 3:] = o.token_ids
    mask = np.zeros((b, t), bool)
    mask[:, 3:] = True
    reward = float(np.mean([o.token_ids[0] for o in outs]))
    adv = np.array([o.token_ids[0] - reward for o in outs], np.float32)
    batch = RolloutBatch(tokens, np.ones((b, t), bool), mask, np.zeros((b, t), np.float32), adv)
    return batch, {"reward_mean": reward}


class FakeTask:
    """``TaskRuntime`` over the fakes, through the real ``Colocated`` leased phase groups."""

    def __init__(self, name: str, dev: FakeDevice, rec: PhaseRecorder, seed: int = 0,
                 fail_at: tuple[str, int | None] | None = None) -> None:  # fmt: skip
        self.name, self.dev, self.rec, self.seed, self.fail_at = name, dev, rec, seed, fail_at
        self.engine: ManagedEngine | None = None
        self.life: Colocated | None = None
        self.batch: RolloutBatch | None = None
        self.rewards: dict[int, float] = {}
        self.bytes_after: list[int] = []  # this task's device bytes after each of its leases

    def run_lease(self, lease: Lease) -> None:
        with self.rec.for_task(self.name):
            if lease.kind == SETUP:
                with self.rec.phase(ENGINE_READY):
                    engine = ManagedEngine(FakeEngine(self.dev, self.name))
                self.engine = engine
                if self.fail_at == (SETUP, None):  # the engine's bytes are on the device now
                    raise RuntimeError(f"injected failure in {self.name} setup")
                fail_at = self.fail_at[1] if self.fail_at and self.fail_at[0] == TRAIN else None
                nan_at = self.fail_at[1] if self.fail_at and self.fail_at[0] == "nan" else None
                self.life = colocate(
                    _Backend(), engine, self.rec, LifecycleOptions(),
                    lambda: (FakeTrainer(self.dev, self.name, self.seed, fail_at, nan_at), {}),
                )  # fmt: skip
                self.life.park()
            elif lease.kind == ROLLOUT:
                self.batch, metrics = self.life.rollout_lease(lease.step, self._rollout)
                self.rewards[lease.step] = metrics["reward_mean"]
            elif lease.kind == TRAIN:
                self.life.train_lease(lease.step, self.batch)
            elif lease.kind == FINAL:
                self.life.final_lease(
                    lambda engine: {"greedy_reward_mean": _rollout(engine, 0)[1]["reward_mean"]}
                )
            self.life.check_asleep()
            self.bytes_after.append(self.dev.of_task(self.name))

    def _rollout(self, engine: ManagedEngine, step: int | None) -> tuple[RolloutBatch, dict[str, Any]]:
        out = _rollout(engine, step)
        if self.fail_at == (ROLLOUT, step):  # the engine is awake: weights and KV cache resident
            raise RuntimeError(f"injected failure in {self.name} rollout {step}")
        return out

    def fail(self, lease: Lease, error: BaseException) -> None:
        if self.engine is None:
            return
        with self.rec.for_task(self.name):
            if self.life is not None:
                self.life.release_on_fault(lease.step)
            else:  # failed before its trainer existed: the engine's memory still goes
                release_on_fault(_Backend(), self.engine, None, self.rec, LifecycleOptions(), lease.step)


class ThreadCoordinator:
    """``Coordinator`` for N "processes" that are threads of one test (``Hub`` shared)."""

    class Hub:
        def __init__(self, count: int, timeout_s: float = 30.0) -> None:
            self.count, self.timeout_s = count, timeout_s
            self.values: dict[str, dict[int, str]] = defaultdict(dict)
            self.cv = threading.Condition()

    def __init__(self, hub: ThreadCoordinator.Hub, index: int) -> None:
        self.hub, self.index, self.count = hub, index, hub.count
        self.seq: dict[str, int] = defaultdict(int)

    def gather(self, name: str, value: str) -> list[str]:
        key = f"{name}#{self.seq[name]}"
        self.seq[name] += 1
        hub = self.hub
        with hub.cv:
            hub.values[key][self.index] = value
            hub.cv.notify_all()
            if not hub.cv.wait_for(lambda: len(hub.values[key]) == hub.count, timeout=hub.timeout_s):
                raise RuntimeError(f"{key}: not every process arrived within {hub.timeout_s}s")
            return [hub.values[key][i] for i in range(hub.count)]

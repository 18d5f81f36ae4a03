"""Named fakes of a rollout engine, a trainer and a backend, for in-process tests of the core.

They stand in for the real engines (sglang-jax, SGLang, the embedded torch engine) and trainers
so that ``mllm_rl.lifecycle.Colocated`` and ``mllm_rl.engine_state.ManagedEngine`` can be driven
through every phase in milliseconds; the real ones are covered end to end by the engine contract
suite and the ``python -m mllm_rl.run`` tests. What the fakes model exactly:

- one device (``FakeDevice``): an exact ledger of device bytes per owner (``engine.weights``,
  ``engine.kv_cache``, ``trainer.params``, ...), read by ``FakeProbe`` into the phase records;
- ``FakeEngine`` (``mllm_rl.engine.EnginePrimitives``): generation whose in-flight requests the
  test controls (``hold()``), that returns them cut short (``finish_reason="abort"``) on
  ``pause_generation``; release/resume per tag with byte accounting; weights restored by a
  resume only with ``weights_cpu_backup`` (else they are garbage until overwritten);
  ``update_weights`` with the fingerprint of what it received; greedy tokens that are a function
  of its weights, so garbage weights decode garbage;
- ``FakeTrainer`` (``mllm_rl.trainer.Trainer``): params and optimizer state moved on/off the
  device with exact bytes, full or LoRA-style partial weight export, a fingerprint, the same
  greedy decoder over its own weights;
- ``FakeBackend``: ``empty_cache`` counted; ``MemorySink``: phase records kept in memory.

The fakes never raise on a misuse the core must prevent: they record it in ``violations``
(what a real engine would do instead is undefined: crash, hang, or serve garbage), so a test can
show both that the core refuses and, with the refusal removed, that the misuse happens.

Weights are tiny float32 arrays ``name -> [rows, cols]``; nothing here imports jax or torch.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mllm_rl.engine import (
    ABORT,
    TAG_KV,
    TAG_WEIGHTS,
    Fingerprint,
    GenerateOutput,
    Placed,
    SamplingParams,
    UpdateStats,
    WeightExport,
)
from mllm_rl.phases.probe import DeviceMemory
from mllm_rl.phases.recorder import Sink
from mllm_rl.trainer import OPTIMIZER, PARAMS, RolloutBatch, check_state_names, train_metrics

VOCAB = 64
# name -> shape of every weight; the q_proj/v_proj layers are what a LoRA-style trainer changes.
SHAPES: dict[str, tuple[int, int]] = {
    "model.embed_tokens.weight": (VOCAB, 8),
    "model.layers.0.self_attn.q_proj.weight": (8, 8),
    "model.layers.0.self_attn.v_proj.weight": (8, 8),
    "model.layers.0.mlp.up_proj.weight": (16, 8),
    "lm_head.weight": (VOCAB, 8),
}
LORA_NAMES = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight")
KV_BYTES = 64 * 1024
CUDA_GRAPH_BYTES = 4 * 1024


def initial_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """The checkpoint both fakes start from: ``name -> float32 [rows, cols]``."""
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def nbytes(weights: Mapping[str, np.ndarray]) -> int:
    return int(sum(w.nbytes for w in weights.values()))


def fingerprint(weights: Mapping[str, np.ndarray], names: Iterable[str] | None = None) -> Fingerprint:
    """(sum, sum of squares) in float64 per tensor: what real engines and trainers report."""
    names = list(weights) if names is None else list(names)
    return {n: (float(weights[n].sum(dtype=np.float64)), float(np.square(weights[n], dtype=np.float64).sum()))
            for n in names}  # fmt: skip


def greedy_tokens(weights: Mapping[str, np.ndarray], prompt: Sequence[int], n: int) -> list[int]:
    """A deterministic "greedy decoder": ``n`` token ids, a function of every weight byte and the
    prompt. Equal weights give equal tokens; any differing weight gives other tokens."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(weights):
        h.update(name.encode())
        h.update(np.ascontiguousarray(weights[name]).tobytes())
    h.update(np.asarray(prompt, np.int64).tobytes())
    out = []
    for i in range(n):
        d = h.copy()
        d.update(i.to_bytes(4, "little"))
        out.append(int.from_bytes(d.digest()[:4], "little") % VOCAB)
    return out


class FakeDevice:
    """One device: an exact ledger of bytes per owner, and its all-time peak."""

    def __init__(self, capacity: int = 1 << 30) -> None:
        self.capacity = capacity
        self.owners: dict[str, int] = {}
        self.peak = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return sum(self.owners.values())

    def alloc(self, owner: str, n: int) -> None:
        with self._lock:
            if owner in self.owners:
                raise RuntimeError(f"fake device: {owner} allocated twice")
            self.owners[owner] = int(n)
            self.peak = max(self.peak, self.used)

    def free(self, owner: str) -> int:
        with self._lock:
            return self.owners.pop(owner)

    def holds(self, owner: str) -> bool:
        return owner in self.owners


class FakeProbe:
    """``MemoryProbe`` over a ``FakeDevice`` (its ledger plays the allocator's statistics)."""

    def __init__(self, device: FakeDevice) -> None:
        self.device = device

    def snapshot(self) -> list[DeviceMemory]:
        d = self.device
        return [DeviceMemory(0, "fake", d.used, None, d.capacity, "memory_stats", {"owners": dict(d.owners)})]

    def in_use(self) -> list[int | None]:
        return [self.device.used]


class FakeEngine:
    """``EnginePrimitives`` on a ``FakeDevice``. Knobs (all off by default):

    - ``weights_cpu_backup``: a released weights tag is restored by resume (else garbage);
    - ``resume_lies``: loses the CPU backup but reports the weights restored (a lying adapter);
    - ``drop_updates``: receives tensors (and fingerprints them) but installs nothing;
    - ``max_installed``: stops installing after this many tensors of one update;
    - ``ignore_pause``: requests in flight do not return on ``pause_generation`` (a hung engine);
    - ``unproven``: the tensors it leaves out of ``UpdateStats.installed`` (an adapter that cannot
      prove their install, so the update check reads them back: ``read_names``).

    An update claims ``installed`` as the JAX adapter does: the tensors whose fingerprinted array
    is the one it now holds (a dropped tensor is not).

    ``hold()`` makes every later ``generate`` block until ``let_go()`` or a pause, so a test
    controls what is in flight; ``started`` is set once a held request is inside the engine.
    """

    def __init__(
        self,
        device: FakeDevice,
        weights: Mapping[str, np.ndarray] | None = None,
        weights_cpu_backup: bool = False,
        tags: tuple[str, ...] = (TAG_WEIGHTS, TAG_KV),
        resume_lies: bool = False,
        drop_updates: bool = False,
        max_installed: int | None = None,
        ignore_pause: bool = False,
        unproven: frozenset[str] = frozenset(),
    ) -> None:
        self.device = device
        self.unproven = unproven
        self.read_names: list[str] = []  # what weights_fingerprint read, in order
        self.tags = tags
        self.weights_cpu_backup = weights_cpu_backup
        self.resume_lies, self.drop_updates = resume_lies, drop_updates
        self.max_installed, self.ignore_pause = max_installed, ignore_pause
        # Dummy weights (random, not the checkpoint's), as an engine started with dummy init has.
        self.weights = {n: w.copy() for n, w in (weights or initial_weights(seed=99)).items()}
        self.garbage: set[str] = set()  # weights whose contents are undefined
        self._backup: dict[str, np.ndarray] | None = None
        self.resident = set(tags)
        for tag in tags:
            device.alloc(self._owner(tag), self._tag_bytes(tag))
        self.paused = False
        self.running = 0  # requests inside generate() right now (the engine's own truth)
        self.calls: list[str] = []  # primitive calls in order
        self.violations: list[str] = []  # misuses a real engine would not survive
        self.started = threading.Event()
        self._next_gate: threading.Event | None = None  # taken by the next generate call
        self._held: list[threading.Event] = []  # gates of requests held so far
        self._lock = threading.Condition()

    # -- bookkeeping ------------------------------------------------------------------------
    @staticmethod
    def _owner(tag: str) -> str:
        return f"engine.{tag}"

    def _tag_bytes(self, tag: str) -> int:
        return {TAG_WEIGHTS: nbytes(self.weights), TAG_KV: KV_BYTES}.get(tag, CUDA_GRAPH_BYTES)

    def _violation(self, what: str) -> None:
        self.violations.append(what)

    # -- generation -------------------------------------------------------------------------
    def hold(self) -> None:
        """The next ``generate`` call stays in flight until ``let_go()`` or a pause."""
        self._next_gate = threading.Event()
        self.started.clear()

    def let_go(self) -> None:
        for gate in self._held:
            gate.set()

    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerateOutput]:
        self.calls.append("generate")
        released = sorted(set(self.tags) - self.resident)
        if released:
            self._violation(f"generate with {released} released")
        if self.garbage:
            self._violation(f"generate on undefined weights ({len(self.garbage)} tensor(s))")
        if self.paused:
            self._violation("generate while paused")
        with self._lock:
            self.running += len(input_ids)
        try:
            gate, self._next_gate = self._next_gate, None
            aborted = False
            if gate is not None:
                self._held.append(gate)
                self.started.set()
                while not gate.wait(0.002):
                    if self.paused and not self.ignore_pause:
                        aborted = True
                        break
            outs = []
            for prompt in input_ids:
                toks = greedy_tokens(self.weights, prompt, 1 if aborted else sampling.max_new_tokens)
                reason = ABORT if aborted else "length"
                outs.append(GenerateOutput(toks, [-1.0] * len(toks), " ".join(map(str, toks)), reason))
            return outs
        finally:
            with self._lock:
                self.running -= len(input_ids)
                self._lock.notify_all()

    def pause_generation(self) -> None:
        self.calls.append("pause_generation")
        self.paused = True

    def continue_generation(self) -> None:
        self.calls.append("continue_generation")
        if TAG_KV not in self.resident:
            self._violation("continue_generation with kv_cache released")
        self.paused = False

    def flush_cache(self) -> None:
        self.calls.append("flush_cache")

    # -- memory tags ------------------------------------------------------------------------
    def tag_bytes(self, tag: str) -> int:
        return self._tag_bytes(tag) if tag in self.resident else 0

    def weight_bytes(self) -> int:
        return nbytes(self.weights)

    def release_memory(self, tag: str) -> None:
        self.calls.append(f"release:{tag}")
        if tag not in self.resident:
            self._violation(f"release({tag}) of a tag that is not resident")
            return
        if self.running:
            self._violation(f"release({tag}) with {self.running} request(s) running")
        if tag == TAG_WEIGHTS:
            keep = self.weights_cpu_backup and not self.resume_lies
            self._backup = {n: w.copy() for n, w in self.weights.items()} if keep else None
        self.device.free(self._owner(tag))
        self.resident.discard(tag)

    def resume_memory(self, tag: str) -> bool:
        self.calls.append(f"resume:{tag}")
        if tag in self.resident:
            self._violation(f"resume({tag}) of a resident tag")
            return tag == TAG_WEIGHTS
        self.device.alloc(self._owner(tag), self._tag_bytes(tag))
        self.resident.add(tag)
        if tag != TAG_WEIGHTS:
            return False  # KV contents are undefined after a resume, and never read before written
        if self._backup is not None:
            self.weights, self._backup = self._backup, None
            return True
        # Stale bytes: what a re-allocation without restore leaves behind.
        self.weights = {n: np.full_like(w, 7.0) for n, w in self.weights.items()}
        self.garbage = set(self.weights)
        return self.resume_lies

    # -- weights ----------------------------------------------------------------------------
    def weight_names(self) -> list[str]:
        return list(self.weights)

    def memory_tag(self, tag: str) -> str:
        return tag

    def place(self, hf_name: str, value: Any) -> np.ndarray:
        """A copy of ``value`` on the device (owner ``engine.placed.<name>``) until installed."""
        self.calls.append("place")
        new = np.array(value, dtype=np.float32, copy=True)
        self.device.alloc(f"engine.placed.{hf_name}", new.nbytes)
        return new

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], on_tensor: Any = None) -> UpdateStats:
        self.calls.append("update_weights")
        if TAG_WEIGHTS not in self.resident:
            self._violation("update_weights with weights released")
        t0 = time.perf_counter()
        received: dict[str, np.ndarray] = {}
        for name, value in named_tensors:
            placed = isinstance(value, Placed)
            new = value.value if placed else np.array(value, dtype=np.float32, copy=True)
            received[name] = new
            if self.drop_updates or (self.max_installed is not None and len(received) > self.max_installed):
                continue
            owner = f"engine.placed.{name}" if placed else f"engine.incoming.{name}"
            if not placed:
                self.device.alloc(owner, new.nbytes)  # the new tensor placed, the old one still resident
            if on_tensor is not None:
                on_tensor(name, new.nbytes)
            self.device.free(owner)
            self.weights[name] = new
            self.garbage.discard(name)
        n = len(received) if self.max_installed is None else min(len(received), self.max_installed)
        installed = frozenset(k for k, v in received.items() if self.weights.get(k) is v) - self.unproven
        return UpdateStats(
            n, nbytes(received), time.perf_counter() - t0, fingerprint(received), installed=installed
        )

    def weights_fingerprint(self, names: Sequence[str] | None = None) -> Fingerprint:
        self.calls.append("weights_fingerprint")
        read = self.weights if names is None else {n: self.weights[n] for n in names}
        self.read_names += list(read)
        return fingerprint(read)

    def shutdown(self) -> None:
        self.calls.append("shutdown")
        for tag in list(self.resident):
            self.device.free(self._owner(tag))
        self.resident.clear()


class FakeSnapshot:
    """``FakeTrainer.snapshot``: a host copy of the weights, written as ``save`` writes them
    (after ``gate``, when given, is set)."""

    def __init__(self, weights: dict[str, np.ndarray], gate: threading.Event | None = None) -> None:
        self.weights, self.gate = weights, gate
        self.nbytes = nbytes(weights)

    def write(self, path: Path) -> None:
        if self.gate is not None and not self.gate.wait(30):
            raise TimeoutError("snapshot gate never opened")
        np.savez(Path(path) / "weights.npz", **self.weights)


class FakeTrainer:
    """``Trainer`` on a ``FakeDevice``: params (``nbytes`` of the weights) and AdamW-like optimizer
    state (twice that) are on the device or on the host, with exact bytes.

    ``lora=True`` trains only ``LORA_NAMES`` and exports only them unless asked for the full
    weights (what a LoRA trainer exports: the merged adapted layers). Knobs: ``offload_noop``
    (the params offload moves nothing, like the ``offload_noop`` fault), ``stale_fingerprint``
    (its fingerprint is of the weights before the last step: what it claims != what it sends),
    ``snapshots`` (``snapshot()`` copies the weights for a background write; ``False``: saves only
    in place), ``snapshot_gate`` (each snapshot's write waits for this event first),
    ``export_fingerprint`` (the export carries its fingerprint, taken as it yields, as the real
    trainers' do; ``fingerprint_reads`` counts the separate ``weights_fingerprint`` passes).
    """

    def __init__(
        self,
        device: FakeDevice,
        weights: Mapping[str, np.ndarray] | None = None,
        lora: bool = False,
        lr: float = 0.01,
        offload_noop: bool = False,
        stale_fingerprint: bool = False,
        snapshots: bool = True,
        snapshot_gate: threading.Event | None = None,
        export_fingerprint: bool = False,
    ) -> None:
        self.device = device
        self.export_fingerprint, self.fingerprint_reads = export_fingerprint, 0
        self.snapshots, self.snapshot_gate = snapshots, snapshot_gate
        self.weights = {n: w.copy() for n, w in (weights or initial_weights()).items()}
        self.lora, self.lr = lora, lr
        self.offload_noop, self.stale_fingerprint = offload_noop, stale_fingerprint
        self._before_step = {n: w.copy() for n, w in self.weights.items()}
        self.steps = 0
        self.bytes = {PARAMS: nbytes(self.weights), OPTIMIZER: 2 * nbytes(self._trained())}
        self.on = {PARAMS: True, OPTIMIZER: True}
        for what, n in self.bytes.items():
            device.alloc(f"trainer.{what}", n)

    def _trained(self) -> dict[str, np.ndarray]:
        return {n: w for n, w in self.weights.items() if not self.lora or n in LORA_NAMES}

    def _need(self, *what: str, op: str) -> None:
        off = [w for w in what if not self.on[w]]
        if off:
            raise RuntimeError(f"{op} refused: {off} offloaded; onload first")

    # -- the protocol -------------------------------------------------------------------------
    def train_step(self, batch: RolloutBatch) -> dict[str, float]:
        """One update: every trained tensor moves by ``lr * (1 + mean advantage)``."""
        self._need(PARAMS, OPTIMIZER, op="train_step")
        t0 = time.perf_counter()
        self._before_step = {n: w.copy() for n, w in self.weights.items()}
        delta = np.float32(self.lr * (1.0 + float(batch.advantages.mean())))
        for name in self._trained():
            self.weights[name] = self.weights[name] + delta
        self.steps += 1
        tokens = float(batch.loss_mask.sum())
        return train_metrics(0.0, 1, [1.0], {"tokens": tokens}, time.perf_counter() - t0)

    def logprobs(self, batch: RolloutBatch) -> np.ndarray:
        self._need(PARAMS, op="logprobs")
        return np.where(batch.loss_mask, -1.0, 0.0).astype(np.float32)

    def offload(self, what: Sequence[str]) -> int:
        moved = 0
        for w in check_state_names(what):
            if not self.on[w]:
                continue
            moved += self.bytes[w]
            if w == PARAMS and self.offload_noop:
                continue  # reports the bytes, moves nothing
            self.device.free(f"trainer.{w}")
            self.on[w] = False
        return moved

    def onload(self, what: Sequence[str]) -> int:
        back = 0
        for w in check_state_names(what):
            if self.on[w]:
                continue
            self.device.alloc(f"trainer.{w}", self.bytes[w])
            self.on[w] = True
            back += self.bytes[w]
        return back

    def resident(self) -> dict[str, bool]:
        return dict(self.on)

    def state_bytes(self) -> dict[str, int]:
        return dict(self.bytes)

    def greedy(self, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        self._need(PARAMS, op="greedy")
        return greedy_tokens(self.weights, prompt, n), [1.0] * n

    def export_weights(self, full: bool = True) -> WeightExport:
        self._need(PARAMS, op="export_weights")
        names = list(self.weights) if full or not self.lora else list(LORA_NAMES)
        full = len(names) == len(self.weights)
        if not self.export_fingerprint:
            return WeightExport.of([(n, self.weights[n].copy()) for n in names], full=full)
        claimed = self._before_step if self.stale_fingerprint else self.weights
        sent: list[str] = []

        def gen() -> Iterable[tuple[str, np.ndarray]]:
            for n in names:
                sent.append(n)  # its sums are taken as it goes (here: read from ``claimed``)
                yield n, self.weights[n].copy()

        return WeightExport(names, gen(), full=full, fingerprint=lambda: fingerprint(claimed, sent))

    def weights_fingerprint(self, names: Sequence[str] | None = None) -> Fingerprint:
        self._need(PARAMS, op="weights_fingerprint")
        self.fingerprint_reads += 1
        return fingerprint(self._before_step if self.stale_fingerprint else self.weights, names)

    def save(self, path: Path) -> None:
        self._need(PARAMS, OPTIMIZER, op="save")
        np.savez(Path(path) / "weights.npz", **self.weights)

    def snapshot(self, path: Path | None = None) -> FakeSnapshot | None:
        """A copy of the weights a background thread writes (``None`` with ``snapshots=False``)."""
        if not self.snapshots:
            return None
        self._need(PARAMS, OPTIMIZER, op="snapshot")
        return FakeSnapshot({n: w.copy() for n, w in self.weights.items()}, self.snapshot_gate)

    def restore(self, path: Path) -> None:
        with np.load(Path(path) / "weights.npz") as f:
            self.weights = {n: f[n].copy() for n in self.weights}


class FakeBackend:
    """What ``Colocated`` needs of a backend: ``empty_cache`` (counted)."""

    name = "fake"

    def __init__(self) -> None:
        self.empty_cache_calls = 0

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1


class MemorySink(Sink):
    """A ``PhaseRecorder`` sink that keeps every record and every metrics line in memory."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.metrics: list[tuple[int, dict[str, Any]]] = []
        self.closed_with: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        self.records.append(record)

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.metrics.append((step, dict(metrics)))

    def close(self, exit_code: int = 0) -> None:
        self.closed_with = exit_code

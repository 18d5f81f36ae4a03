"""``FakeRunBackend``: a fake ``mllm_rl.backend.Backend`` for tests, which ``python -m mllm_rl.run``
runs end to end in a second or two (``tests/fake_run.py`` starts such a run).

It is made of the named fakes of ``tests/fakes.py``: one ``FakeDevice`` read by a ``FakeProbe``, a
``FakeEngine`` and a ``FakeRunTrainer`` (``FakeTrainer`` with what a run needs besides: a loss,
checkpoints through temporary files). No jax or torch is imported; the model directory and its
tokenizer are real (the run renders prompts and decodes completions with them), the fake weights
do not depend on them. Everything the run does around the backend is the product's own: options,
preflight, phase recorder and its sinks, lifecycle checks, checkpoint writer, watchdog, report and
exit codes. What it cannot stand for: a real engine's threads and memory, a real trainer's
numerics, the backends' checkpoint formats and their error translation (orbax, torch's writer),
and their fault injections' error messages. Those keep one real-engine run each in tests/jax and
tests/torch.

The faults of ``mllm_rl.faults`` are injected where the real backends inject them: ``train_oom``
and ``offload_noop`` in the trainer, ``resume_lies`` in the engine; ``reward_nan``, ``hang`` and
``hang_deaf`` in the core, as for every backend.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from mllm_rl.backend import Backend
from mllm_rl.faults import fault
from tests.fakes import FakeDevice, FakeEngine, FakeProbe, FakeTrainer, initial_weights

STATE_FILE = "state.npz"
# One tensor beyond ``tests.fakes.SHAPES``, so that the weights are over 1 MiB: a checkpoint (params
# and two moments, ~3.8 MiB) is larger than the 1 MiB file-size limit of
# tests/core/test_checkpoint_faults.py, and a LoRA task's train lease (its params on the device)
# holds more than the 1 MiB tests/core/test_multitask_fake_run.py needs freed.
PADDING = ("model.layers.0.mlp.down_proj.weight", (320, 1024))


def run_weights(seed: int) -> dict[str, np.ndarray]:
    """The fake model's weights: ``tests.fakes.initial_weights`` plus ``PADDING``."""
    name, shape = PADDING
    w = initial_weights(seed)
    w[name] = np.random.default_rng(seed + 1).standard_normal(shape).astype(np.float32)
    return w


def write_state(arrays: dict[str, np.ndarray], path: Path) -> None:
    """``path/STATE_FILE`` written through a temporary name; a write the OS refuses raises
    ``OSError`` naming the temporary file (as the backends' writers name theirs) and leaves none."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    tmp = Path(path) / f".{STATE_FILE}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(buf.getvalue())
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(tmp)) from None
    os.replace(tmp, Path(path) / STATE_FILE)


class FakeStateSnapshot:
    """``FakeRunTrainer.snapshot``: a host copy of the state, written as ``save`` writes it."""

    def __init__(self, arrays: dict[str, np.ndarray]) -> None:
        self.arrays = arrays
        self.nbytes = int(sum(a.nbytes for a in arrays.values()))

    def write(self, path: Path) -> None:
        write_state(self.arrays, path)


class FakeRunTrainer(FakeTrainer):
    """``FakeTrainer`` as a run's trainer: a loss and a grad norm from the batch's advantages (a
    NaN advantage makes both NaN), optimizer moments saved with the params, and the trainer faults
    (``train_oom`` raises as JAX's allocator does, ``offload_noop`` keeps the params)."""

    def __init__(self, device: FakeDevice, lora: bool, lr: float) -> None:
        super().__init__(device, weights=run_weights(0), lora=lora, lr=lr, offload_noop=fault("offload_noop"))
        self.moments = {n: np.zeros((2, *w.shape), np.float32) for n, w in self._trained().items()}

    def train_step(self, batch: Any) -> dict[str, float]:
        self._need("params", "optimizer", op="train_step")
        if fault("train_oom"):
            raise RuntimeError(
                "RESOURCE_EXHAUSTED: Out of memory while trying to allocate (injected: train_oom)"
            )
        out = super().train_step(batch)
        adv = np.asarray(batch.advantages, np.float64)
        out["loss"] = float(-adv.mean())
        out["grad_norm"] = float(np.abs(adv).mean())
        return out

    def _state(self) -> dict[str, np.ndarray]:
        return {**{f"w/{n}": w for n, w in self.weights.items()},
                **{f"m/{n}": m for n, m in self.moments.items()}}  # fmt: skip

    def save(self, path: Path) -> None:
        self._need("params", "optimizer", op="save")
        write_state(self._state(), path)

    def snapshot(self, path: Path | None = None) -> FakeStateSnapshot:
        self._need("params", "optimizer", op="snapshot")
        return FakeStateSnapshot({k: v.copy() for k, v in self._state().items()})

    def restore(self, path: Path) -> None:
        target = Path(path) / STATE_FILE
        if not target.exists():
            raise ValueError(f"{target}: no trainer state here")
        with np.load(target) as f:
            self.weights = {n: f[f"w/{n}"].copy() for n in self.weights}
            self.moments = {n: f[f"m/{n}"].copy() for n in self.moments}


class FakeRunBackend(Backend):
    """A fake backend (tests only): ``FakeEngine`` and ``FakeRunTrainer`` on one ``FakeDevice``."""

    name = "fake"
    ready_phase = "fake_ready"
    engines = {"auto": "FakeEngine (tests/fakes.py)"}

    def __init__(self) -> None:
        self.device = FakeDevice()

    def init_runtime(self, tp: int = 1, platform: str = "auto") -> dict[str, Any]:
        """``FAKE_RUNTIME_UP_S`` (seconds, default 0): how long the runtime takes to come up, as a
        real one takes seconds; two runs started together then both pass the preflight before
        either takes the run directory's lock (tests/core/test_run_dir.py). ``FAKE_RUNTIME_GATE``:
        a path; the runtime writes ``<path>.up`` and comes up once ``<path>`` exists."""
        time.sleep(float(os.environ.get("FAKE_RUNTIME_UP_S", "0")))
        if gate := os.environ.get("FAKE_RUNTIME_GATE"):
            Path(gate + ".up").touch()
            while not Path(gate).exists():
                time.sleep(0.02)
        if platform not in ("auto", "cpu"):
            raise RuntimeError(f"--platform {platform}: the fake backend runs on its fake device only")
        return {"platform": "cpu", "devices": ["fake"], "device_count": 1}

    def memory_probe(self) -> FakeProbe:
        return FakeProbe(self.device)

    def check_engine_args(self, model: Any, opts: Any) -> None:
        if opts.tp != 1:
            raise ValueError(f"--tp {opts.tp}: the fake backend has one device")

    def create_engine(self, model: Any, opts: Any) -> FakeEngine:
        return FakeEngine(
            self.device,
            weights=run_weights(99),  # dummy weights, as an engine started with dummy init has
            weights_cpu_backup=opts.weights_cpu_backup,
            resume_lies=fault("resume_lies"),
        )

    def create_trainer(self, model: Any, cfg: Any) -> FakeRunTrainer:
        return FakeRunTrainer(self.device, lora=cfg.lora_rank > 0, lr=cfg.lr)

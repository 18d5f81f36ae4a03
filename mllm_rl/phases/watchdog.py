"""Per-phase watchdog: a phase past its limit (``PhaseLimits``) has every thread's stack written to
``<out_dir>/stuck-<phase>[-step<k>]-p<process>.txt`` and ``PhaseStuck`` raised in the main thread; one
still stuck after a grace period (a hang in C) gets ``on_hard_exit`` and ``os._exit(6)``."""

from __future__ import annotations

import dataclasses
import faulthandler
import itertools
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mllm_rl import phase_table
from mllm_rl.signals import WAKE_SIGNAL

STUCK_EXIT = 6
DEFAULT_LIMIT_S = 1800.0
# Phases that compute or move a whole model get the full limit, bookkeeping ones LIGHT_FACTOR of it
RUN_HEAVY = ("wandb_init", "jax_ready", "torch_ready", "engine_ready_dummy", "checkpoint_flush")
HEAVY_PHASES = phase_table.HEAVY | frozenset(RUN_HEAVY)
LIGHT_FACTOR = 0.25
HARD_EXIT_BOUND_S = 60.0  # on_hard_exit gets this long before the process ends regardless


@dataclasses.dataclass(frozen=True)
class PhaseLimits:
    """``base_s`` for heavy phases, ``LIGHT_FACTOR * base_s`` for others, ``overrides`` by name; 0: off."""

    base_s: float = DEFAULT_LIMIT_S
    overrides: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def limit(self, phase: str) -> float | None:
        """Seconds ``phase`` may run, or None (no limit)."""
        if phase in self.overrides:
            return self.overrides[phase] or None
        if self.base_s <= 0:
            return None
        return self.base_s * (1.0 if phase in HEAVY_PHASES else LIGHT_FACTOR)

    @classmethod
    def parse(cls, specs: Sequence[str]) -> PhaseLimits:
        """``--phase-timeout`` values: ``SECONDS`` (the base) or ``PHASE=SECONDS``; else ``ValueError``."""
        base, over = DEFAULT_LIMIT_S, {}
        for spec in specs:
            name, _, value = spec.rpartition("=")
            try:
                secs = float(value)
            except ValueError:
                secs = -1.0
            if not secs >= 0 or secs == float("inf") or (name == "" and "=" in spec):
                raise ValueError(
                    f"--phase-timeout {spec!r}: expected SECONDS or PHASE=SECONDS (seconds >= 0)"
                )
            if name:
                over[name] = secs
            else:
                base = secs
        return cls(base, over)


class PhaseStuck(SystemExit):
    """Raised in the main thread past its phase's limit; a ``SystemExit`` (event loops swallow others)."""

    def __init__(self, message: str = "phase stuck", info: dict[str, Any] | None = None) -> None:
        super().__init__(STUCK_EXIT)
        self.message, self.info = message, dict(info or {})

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass
class _Armed:
    token: int
    phase: str
    step: int | None
    limit_s: float
    started: float  # time.monotonic()
    started_wall: float


def dump_stacks(path: Path, header: str) -> Path:
    """Every thread's stack into ``path``: Python frames with thread names, then faulthandler's dump."""
    names = {t.ident: t for t in threading.enumerate()}
    with open(path, "w", encoding="utf-8") as f:
        f.write(header + "\n\n== Python threads (sys._current_frames) ==\n")
        for ident, frame in sys._current_frames().items():
            t = names.get(ident)
            label = f"{t.name} (daemon {t.daemon})" if t is not None else "unnamed"
            f.write(f"\nThread {ident} {label}:\n{''.join(traceback.format_stack(frame))}")
        f.write("\n== faulthandler.dump_traceback(all_threads=True) ==\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    return path


class Watchdog:
    """One per process: ``install`` (main thread) starts it, ``enter``/``leave`` arm and disarm it,
    ``finish`` stops it; ``on_hard_exit(stuck)`` runs when the main thread outlives ``grace_s``."""

    def __init__(
        self,
        limits: PhaseLimits,
        out_dir: Path,
        process_index: int = 0,
        on_hard_exit: Callable[[PhaseStuck], None] | None = None,
        grace_s: float | None = None,
        poll_s: float = 0.5,
    ) -> None:
        self.limits, self.out_dir, self.process_index = limits, Path(out_dir), process_index
        self.on_hard_exit, self.grace_s, self.poll_s = on_hard_exit, grace_s, poll_s
        self.fired: PhaseStuck | None = None
        self._lock = threading.Lock()
        self._armed: _Armed | None = None
        self._tokens = itertools.count(1)
        self._fired_token: int | None = None
        self._raised = False
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def install(self) -> None:
        """Wake-up signal handler (must run in the main thread) and the watching thread."""
        signal.signal(WAKE_SIGNAL, self._on_signal)
        self._thread = threading.Thread(target=self._loop, name="mllm_rl-watchdog", daemon=True)
        self._thread.start()

    def enter(self, phase: str, step: int | None) -> None:
        limit = self.limits.limit(phase)
        now = (time.monotonic(), time.time())
        armed = None if limit is None else _Armed(next(self._tokens), phase, step, limit, *now)
        with self._lock:
            self._armed = armed

    def leave(self) -> None:
        with self._lock:
            self._armed = None

    def finish(self) -> None:
        """The run is over (normally or not): no hard exit from here on."""
        self._done.set()

    def _on_signal(self, signum: int, frame: Any) -> None:
        with self._lock:
            stuck, token, armed = self.fired, self._fired_token, self._armed
            if stuck is None or self._raised or armed is None or armed.token != token:
                return  # not ours, or the phase ended after all
            self._raised = True
        raise stuck

    def _loop(self) -> None:
        while not self._done.wait(self.poll_s):
            with self._lock:
                armed = self._armed
            if armed is not None and time.monotonic() - armed.started > armed.limit_s:
                self._fire(armed)
                return

    def _fire(self, armed: _Armed) -> None:
        where = armed.phase + ("" if armed.step is None else f"-step{armed.step}")
        path = self.out_dir / f"stuck-{where}-p{self.process_index}.txt"
        step = "" if armed.step is None else f" (step {armed.step})"
        header = (
            f"phase {armed.phase}{step} still running after its {armed.limit_s:g} s limit "
            f"(started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(armed.started_wall))}, "
            f"process {self.process_index}, pid {os.getpid()})"
        )
        try:
            dump_stacks(path, header)
        except OSError as e:
            print(f"warning: watchdog: cannot write {path}: {e}", file=sys.stderr, flush=True)
        info = {"limit_s": armed.limit_s, "stacks": str(path)}
        stuck = PhaseStuck(
            f"phase {armed.phase}{step} stuck: still running after its {armed.limit_s:g} s limit "
            f"(--phase-timeout); every thread's stack in {path}",
            info,
        )
        with self._lock:
            self.fired, self._fired_token = stuck, armed.token
        print(f"error: {stuck.message}", file=sys.stderr, flush=True)
        signal.pthread_kill(threading.main_thread().ident, WAKE_SIGNAL)
        grace = self.grace_s if self.grace_s is not None else min(60.0, max(5.0, 0.1 * armed.limit_s))
        if self._done.wait(grace):
            return
        msg = f"error: the main thread did not stop within {grace:g} s of the interrupt: exiting"
        print(msg, file=sys.stderr, flush=True)
        if self.on_hard_exit is not None:
            t = threading.Thread(
                target=self.on_hard_exit, args=(stuck,), name="mllm_rl-hard-exit", daemon=True
            )
            t.start()
            t.join(HARD_EXIT_BOUND_S)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STUCK_EXIT)

"""``ManagedEngine``: the core's state machine around an engine adapter (docs/DESIGN.md, "The lifecycle").

It owns per-tag memory, weight validity (and version) and generation (paused, in flight), and
refuses what the state does not allow before anything changes. An update whose engine fingerprint
differs raises ``WeightMismatch``; one that fails leaves the weights invalid."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mllm_rl.engine import (
    ABORT,
    TAG_KV,
    TAG_WEIGHTS,
    EnginePrimitives,
    EngineStateError,
    Fingerprint,
    GenerateOutput,
    Placed,
    SamplingParams,
    UpdateStats,
    WeightExport,
    WeightMismatch,
    compare_fingerprints,
)


class ManagedEngine:
    def __init__(self, engine: EnginePrimitives) -> None:
        self.engine = engine
        self.tags = tuple(engine.tags)
        self.released: set[str] = set()
        self.weights_valid = True  # dummy weights are "valid" for generation, as in SGLang
        self.weights_version = 0  # +1 per update that landed
        self.paused = False
        self.in_flight = 0
        self.aborted = 0  # requests returned with finish_reason "abort", in total
        self._cv = threading.Condition()
        self._names = list(engine.weight_names())

    # -- state ---------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """A JSON-able view for phase records."""
        with self._cv:
            return {
                "released": sorted(self.released),
                "weights_valid": self.weights_valid,
                "weights_version": self.weights_version,
                "paused": self.paused,
                "in_flight": self.in_flight,
            }

    @property
    def weights_cpu_backup(self) -> bool:
        return bool(self.engine.weights_cpu_backup)

    def weight_names(self) -> list[str]:
        return list(self._names)

    def weight_bytes(self) -> int:
        return self.engine.weight_bytes()

    def tag_bytes(self, tag: str) -> int:
        self._check_tags([tag])
        return 0 if tag in self.released else self.engine.tag_bytes(tag)

    def memory_tag(self, tag: str) -> str:
        """``tag`` as the engine's memory goes by it in the records (``<task>/weights``)."""
        return self.engine.memory_tag(tag)

    # -- generation ------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerateOutput]:
        n = len(input_ids)
        with self._cv:
            if self.released:
                raise EngineStateError(
                    f"generate refused: memory released for {sorted(self.released)}; resume first"
                )
            if not self.weights_valid:
                raise EngineStateError(
                    "generate refused: weights are invalid (resumed without CPU backup); a full update_weights is needed"
                )
            if self.paused:
                raise EngineStateError("generate refused: generation is paused; continue_generation first")
            self.in_flight += n
        try:
            outs = self.engine.generate(input_ids, sampling)
        finally:
            with self._cv:
                self.in_flight -= n
                self._cv.notify_all()
        with self._cv:
            self.aborted += sum(o.finish_reason == ABORT for o in outs)
        return outs

    def drain(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Pause, wait until no request is in flight, flush the cache (``EngineStateError`` after
        ``timeout_s``)."""
        t0 = time.perf_counter()
        with self._cv:
            self.paused = True
            in_flight, aborted0 = self.in_flight, self.aborted
        self.engine.pause_generation()
        with self._cv:
            if not self._cv.wait_for(lambda: self.in_flight == 0, timeout=timeout_s):
                raise EngineStateError(
                    f"drain: {self.in_flight} request(s) still in flight after {timeout_s}s"
                )
            aborted = self.aborted - aborted0
        self.engine.flush_cache()
        return {
            "in_flight_at_pause": in_flight,
            "aborted": aborted,
            "drain_s": round(time.perf_counter() - t0, 4),
        }

    def continue_generation(self) -> None:
        with self._cv:
            if TAG_KV in self.released:
                raise EngineStateError("continue_generation refused: kv_cache is released; resume it first")
            self.paused = False
        self.engine.continue_generation()

    def flush_cache(self) -> None:
        self.engine.flush_cache()

    # -- memory tags -----------------------------------------------------------------------
    def _check_tags(self, tags: Sequence[str]) -> list[str]:
        unknown = [t for t in tags if t not in self.tags]
        if unknown:
            raise ValueError(f"unknown memory tag(s) {unknown}; this engine has {list(self.tags)}")
        return list(dict.fromkeys(tags))

    def release(self, tags: Sequence[str]) -> dict[str, int]:
        """Free the device memory of ``tags``; returns the bytes each held."""
        tags = self._check_tags(tags)
        with self._cv:
            if self.in_flight or not self.paused:
                raise EngineStateError(
                    f"release refused: {self.in_flight} request(s) in flight, generation "
                    f"{'paused' if self.paused else 'running'}; drain() first"
                )
        held = {}
        for tag in tags:
            if tag in self.released:
                warnings.warn(f"release({tag!r}): already released; no-op", stacklevel=2)
                continue
            held[tag] = self.engine.tag_bytes(tag)
            self.engine.release_memory(tag)
            self.released.add(tag)
        return held

    def resume(self, tags: Sequence[str]) -> dict[str, int]:
        """Re-allocate ``tags``; returns the bytes each holds again. Weights resumed without a
        CPU backup are invalid until a full update."""
        tags = self._check_tags(tags)
        back = {}
        for tag in tags:
            if tag not in self.released:
                warnings.warn(f"resume({tag!r}): not released; no-op", stacklevel=2)
                continue
            restored = self.engine.resume_memory(tag)
            self.released.discard(tag)
            if tag == TAG_WEIGHTS and not restored:
                self.weights_valid = False
            back[tag] = self.engine.tag_bytes(tag)
        return back

    # -- weights ---------------------------------------------------------------------------
    def check_update(self, export: WeightExport) -> None:
        """Everything ``update_weights`` refuses, checked without touching the engine."""
        if TAG_WEIGHTS in self.released:
            raise EngineStateError("update_weights refused: weights are released; resume(['weights']) first")
        if self.in_flight:
            raise EngineStateError(
                f"update_weights refused: {self.in_flight} request(s) in flight; drain() first"
            )
        known = set(self._names)
        unknown = [n for n in export.names if n not in known]
        if unknown:
            raise ValueError(
                f"update_weights: unknown parameter(s) for this engine: {', '.join(unknown[:3])}"
            )
        if len(set(export.names)) != len(export.names):
            raise ValueError("update_weights: duplicate parameter names")
        if export.full:
            missing = [n for n in self._names if n not in set(export.names)]
            if missing:
                raise ValueError(
                    f"update_weights: full update misses {len(missing)} parameter(s), e.g. {', '.join(missing[:3])}"
                )
        elif not self.weights_valid:
            raise EngineStateError(
                "update_weights refused: a partial update on invalid weights (resumed without CPU backup) "
                "would leave the rest undefined; sync the full weights or enable weights CPU backup"
            )

    def update_weights(
        self,
        export: WeightExport,
        on_tensor: Any = None,
        expected: Fingerprint | Callable[[], Fingerprint] | None = None,
    ) -> UpdateStats:
        """Stream ``export`` into the engine; ``WeightMismatch`` unless the engine's fingerprint
        matches what was sent and ``expected`` (the trainer's; a callable: read once the export is
        consumed). Only weights not proven installed (``UpdateStats.installed``) are read back."""
        self.check_update(export)
        try:
            stats = self.engine.update_weights(iter(export), on_tensor=on_tensor)
            if stats.tensors != len(export.names):
                raise WeightMismatch(
                    f"update_weights: {stats.tensors} of {len(export.names)} announced tensors arrived"
                )
            t0 = time.perf_counter()
            if callable(expected):
                expected = expected()
            proven = stats.installed & stats.fingerprint.keys()
            unproven = [n for n in dict.fromkeys((*stats.fingerprint, *(expected or ()))) if n not in proven]
            got = {n: stats.fingerprint[n] for n in proven}
            if unproven:
                got.update(self.engine.weights_fingerprint(unproven))
            stats.read_back = len(unproven)  # tensors read back
            for want, whose in ((stats.fingerprint, "what was sent"), (expected or {}, "the trainer's")):
                if bad := compare_fingerprints(want, got):
                    raise WeightMismatch(
                        f"update_weights: engine weights differ from {whose} for {len(bad)} tensor(s), e.g. {bad[:2]}"
                    )
            stats.check_seconds = time.perf_counter() - t0
        except BaseException:
            # Adapters install in place: some tensors may have landed, so the engine holds
            # neither the old nor the new weights; only a full update makes them valid again.
            self.weights_valid = False
            raise
        if export.full:
            self.weights_valid = True
        self.weights_version += 1
        return stats

    def place_all(self, tensors: Iterable[tuple[str, Any]]) -> WeightExport:
        """The naive swap's first half: place every tensor before installing any (old and new both
        resident); ``update_weights`` of the returned export installs them."""
        if TAG_WEIGHTS in self.released:
            raise EngineStateError("place_all refused: weights are released")
        return WeightExport.of(
            ((name, Placed(self.engine.place(name, arr))) for name, arr in tensors), full=True
        )

    def weights_fingerprint(self) -> Fingerprint:
        if TAG_WEIGHTS in self.released:
            raise EngineStateError("weights_fingerprint refused: weights are released")
        return self.engine.weights_fingerprint()

    def shutdown(self) -> None:
        self.engine.shutdown()

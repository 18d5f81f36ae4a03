"""The rollout-engine contract (DESIGN.md §4), backend-neutral.

Arrays crossing this boundary are host numpy arrays or backend device arrays; the
core never touches their framework.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

Fingerprint = dict[str, tuple[float, float]]  # hf_name -> (sum, sum of squares), float64


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclasses.dataclass
class GenerateOutput:
    token_ids: list[int]  # generated tokens only, [T_out]
    logprobs: list[float]  # log p(token_t | prefix), [T_out]
    text: str
    finish_reason: str


@dataclasses.dataclass
class UpdateStats:
    tensors: int
    bytes: int
    seconds: float
    fingerprint: Fingerprint  # of the tensors as placed on device, before install

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


class RolloutEngine(Protocol):
    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerateOutput]: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], on_tensor: Any = None) -> UpdateStats: ...

    def weights_fingerprint(self) -> Fingerprint: ...

    def flush_cache(self) -> None: ...

    def pause_generation(self) -> None: ...

    def continue_generation(self) -> None: ...

    def shutdown(self) -> None: ...


class WeightMismatch(RuntimeError):
    """An engine's weights differ from what was sent: an update that did not take."""


def compare_fingerprints(want: Fingerprint, got: Fingerprint, rtol: float = 1e-3) -> list[str]:
    """Names whose (sum, sumsq) differ beyond ``rtol`` (relative to sumsq's scale), or are missing."""
    bad = []
    for name, (s, q) in want.items():
        if name not in got:
            bad.append(name)
            continue
        gs, gq = got[name]
        scale = max(abs(q), 1e-12) ** 0.5 * 1e-2 + abs(s) * rtol
        if abs(gq - q) > rtol * max(abs(q), 1e-12) or abs(gs - s) > scale:
            bad.append(name)
    return bad

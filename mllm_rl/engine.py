"""The rollout-engine contract (docs/DESIGN.md, "Contracts"), backend-neutral.

``EnginePrimitives``: what a backend's engine adapter implements, keeping no lifecycle state
(``ManagedEngine``, ``mllm_rl.engine_state``, owns it). Arrays crossing it are host numpy arrays
or backend device arrays; the core never touches their framework."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from mllm_rl.option_error import OptionError
from mllm_rl.options.check import check_fields, opt

Fingerprint = dict[str, tuple[float, float]]  # hf_name -> (sum, sum of squares), float64

TAG_WEIGHTS = "weights"
TAG_KV = "kv_cache"
TAG_CUDA_GRAPH = "cuda_graph"
ABORT = "abort"  # GenerateOutput.finish_reason of a request cut short by pause_generation


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # index of this call's first request in the run's whole batch (seeds: ``request_seeds``)
    request_offset: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise OptionError("max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise OptionError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise OptionError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.request_offset < 0:
            raise ValueError(f"request_offset must be >= 0, got {self.request_offset}")

    def server_params(self) -> dict[str, Any]:
        """The sampling parameters of an SGLang request (sglang and sglang-jax), seed aside."""
        out: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature}
        out["top_p"] = self.top_p
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        return out


DEFAULT_CONTEXT_LENGTH = 512
DEFAULT_MAX_TOTAL_TOKENS = 4096
TASK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")  # an engine's task name: a path- and tag-safe word


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What ``Backend.create_engine(model, opts)`` starts, validated on construction. ``None``: not
    chosen (sizes: the plan's, ``resolved``'s defaults). Multi-task: ``task`` prefixes the memory
    tags (``<task>/weights``); ``ports`` (server, process group) come from the run's one allocator."""

    tp: int = opt("tp")
    engine: str = opt("engine")
    max_total_tokens: int | None = opt("max_total_tokens", given=True)  # --kv-tokens auto: None, sized
    context_length: int | None = opt("context_length")
    max_running_requests: int | None = opt("max_running_requests", default=None)  # None: the engine's own
    seed: int = opt("seed")
    chunk_bytes: int = 64 * 2**20  # streamed updates: tensors above this go in chunks; 0 = whole
    weights_cpu_backup: bool = opt("weights_cpu_backup")
    task: str | None = None
    ports: tuple[int, ...] | None = None
    mem_fraction_static: float | None = opt("mem_fraction_static")  # the engine's share of device memory

    def __post_init__(self) -> None:
        if self.task is not None and (not isinstance(self.task, str) or not TASK_NAME.fullmatch(self.task)):
            raise ValueError(f"engine task {self.task!r}: expected a simple name ({TASK_NAME.pattern})")
        if self.ports is not None and not (
            isinstance(self.ports, tuple)
            and len(self.ports) == 2
            and all(isinstance(p, int) and not isinstance(p, bool) and 0 < p < 65536 for p in self.ports)
        ):
            raise ValueError(f"engine ports {self.ports!r}: expected a tuple of two ports (1..65535)")
        check_fields(self)
        if isinstance(self.max_total_tokens, str):  # the option's word (auto) is the plan's to resolve
            raise OptionError("max_total_tokens", f"must be an integer, got {self.max_total_tokens!r}")
        # bytes here, MiB as the option (--swap-chunk-mb): not bound to it, checked here
        if not isinstance(self.chunk_bytes, int) or isinstance(self.chunk_bytes, bool):
            raise OptionError("chunk_bytes", f"must be an integer, got {self.chunk_bytes!r}")
        if self.chunk_bytes < 0:
            raise OptionError("chunk_bytes", f"must be >= 0, got {self.chunk_bytes}")

    def check_backend(self, backend: str, engines: Mapping[str, str]) -> None:
        """``ValueError`` unless ``engine`` is one of ``backend``'s ``engines``, before any start."""
        if self.engine not in engines:
            have = ", ".join(f"{k} ({v})" for k, v in engines.items())
            raise ValueError(
                f"--engine {self.engine}: not an engine of the {backend} backend; choices: {have}"
            )

    def start_kwargs(self) -> dict[str, Any]:
        """Constructor kwargs every engine adapter takes (``resolved`` sizes; optional knobs only
        when chosen). ``ports`` and the device are each adapter's own."""
        o = self.resolved()
        out: dict[str, Any] = dict(tp=o.tp, max_total_tokens=o.max_total_tokens, context_length=o.context_length,
                                   seed=o.seed, chunk_bytes=o.chunk_bytes, weights_cpu_backup=o.weights_cpu_backup,
                                   task=o.task)  # fmt: skip
        for key in ("max_running_requests", "mem_fraction_static"):
            if getattr(o, key) is not None:
                out[key] = getattr(o, key)
        return out

    def resolved(self) -> EngineOptions:
        """A copy with ``context_length`` / ``max_total_tokens`` defaulted where unset."""
        return dataclasses.replace(
            self,
            context_length=self.context_length or DEFAULT_CONTEXT_LENGTH,
            max_total_tokens=self.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS,
        )


def request_seeds(base: int, n: int, offset: int = 0) -> list[int]:
    """One seed per request from batch seed ``base`` and its index in the run's whole batch: a GRPO
    group's completions differ, and a sample does not depend on its process or sub-batch."""
    return [(base * 1_000_003 + offset + i) % 2**31 for i in range(n)]


@dataclasses.dataclass
class GenerateOutput:
    token_ids: list[int]  # generated tokens only, [T_out]
    logprobs: list[float]  # log p(token_t | prefix) under the sampling distribution, [T_out]
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    # prompt tokens this request did not compute: read from the engine's prefix cache or from
    # another request of its batch with the same prompt (0: it computed its whole prompt)
    cached_tokens: int = 0


@dataclasses.dataclass
class UpdateStats:
    tensors: int
    bytes: int
    seconds: float
    fingerprint: Fingerprint  # of the tensors as received by the engine, before install
    # Names whose ``fingerprint`` is of the very buffers installed (reading back would read the same).
    installed: frozenset[str] = frozenset()
    # Set by ``ManagedEngine.update_weights``: tensors its check read back, and its seconds.
    read_back: int | None = None
    check_seconds: float = 0.0

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("nan")


class WeightExport:
    """Named tensors announced up front (``names``: an engine can refuse before any weight changes),
    streamed as ``(hf_name, array)``; ``full``: every weight. ``fingerprint``: the sender's (sum,
    sumsq) from the export's own pass, callable once consumed (``None``: ask the trainer)."""

    def __init__(
        self,
        names: Sequence[str],
        tensors: Iterable[tuple[str, Any]],
        full: bool,
        fingerprint: Callable[[], Fingerprint] | None = None,
    ) -> None:
        self.names = list(names)
        self._tensors = tensors
        self.full = full
        self.fingerprint = fingerprint

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        announced = set(self.names)
        for name, value in self._tensors:
            if name not in announced:
                raise RuntimeError(f"weight export yielded {name!r}, which it did not announce")
            yield name, value

    @classmethod
    def of(cls, named: Iterable[tuple[str, Any]], full: bool) -> WeightExport:
        """A materialised export (names known because the list is)."""
        items = list(named)
        return cls([n for n, _ in items], items, full)


class Placed(NamedTuple):
    """A weight already on the engine's devices in its layout and dtype, installed as is."""

    value: Any  # the engine's own device array (jax.Array, torch.Tensor)


class EnginePrimitives(Protocol):
    """What an engine adapter implements. Called only through ``ManagedEngine``."""

    tags: tuple[str, ...]  # memory tags it can release: ("weights", "kv_cache"[, "cuda_graph"])
    weights_cpu_backup: bool  # release(weights) keeps a host copy that resume restores

    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerateOutput]:
        """Generate for prompts ``[n][T_i]``; ``pause_generation`` (another thread) aborts them."""

    def weight_names(self) -> list[str]:
        """HF names of every weight; a full update covers exactly these."""

    def memory_tag(self, tag: str) -> str:
        """``tag`` as named in the records (``<task>/weights`` in a multi-task run)."""

    def place(self, hf_name: str, value: Any) -> Any:
        """One HF-layout tensor on the engine's devices in its layout, not installed (``Placed``)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], on_tensor: Any = None) -> UpdateStats:
        """Install tensors one at a time; ``on_tensor(name, nbytes)`` at each one's high point."""

    def weights_fingerprint(self, names: Sequence[str] | None = None) -> Fingerprint:
        """(sum, sumsq) per weight (``names``: only those) of what the engine's forward uses."""

    def weight_bytes(self) -> int: ...

    def tag_bytes(self, tag: str) -> int:
        """Device bytes a resident tag holds."""

    def release_memory(self, tag: str) -> None:
        """Free a resident tag's device memory (weights to host first when ``weights_cpu_backup``)."""

    def resume_memory(self, tag: str) -> bool:
        """Re-allocate a released tag; whether its contents were restored (CPU backup)."""

    def pause_generation(self) -> None: ...

    def continue_generation(self) -> None: ...

    def flush_cache(self) -> None: ...

    def shutdown(self) -> None: ...


class WeightMismatch(RuntimeError):
    """An engine's weights differ from what was sent: an update that did not take."""


class EngineStateError(RuntimeError):
    """An operation the engine's state does not allow; refused before anything changes."""


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

"""Every SGLang (``CALLS``, reached only through ``construct`` / ``invoke`` / ``attr`` / ``key``)
and torch_memory_saver (``TMS_CALLS``) touch-point of the torch backend, declared once and checked
against the pinned wheels' source by ``tests/torch/test_sglang_conformance.py``. Imports neither
torch nor sglang (the memory planner reads it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

SGLANG_VERSION = "0.5.23"  # the wheel the adapter targets (pip download sglang==0.5.23)
TORCH_MEMORY_SAVER_VERSION = "0.0.10"

# Arguments the adapter starts ``Engine`` with when the caller does not set them.
MEM_FRACTION_STATIC = 0.6  # SGLang's static share (weights + KV pool) of the free memory at start
MAX_RUNNING_REQUESTS = 128
CHUNK_BYTES = 64 * 2**20  # one ``update_weights_from_tensor`` call carries at least this much (last: less)

KINDS = tuple(
    "kwargs fields method coroutine agen attribute constant keys key_values tuple_first absent".split()
)


@dataclasses.dataclass(frozen=True)
class Call:
    """One thing used from an upstream module, as the conformance test checks it in the wheel. ``kind``:

    - ``kwargs``: a class built with keywords ``kwargs`` (``Engine``: ``ServerArgs`` fields);
      ``values``: literals passed for some keywords, which the field's choices must allow;
    - ``fields``: a result object whose fields ``kwargs`` we read;
    - ``method`` / ``coroutine`` / ``agen``: a sync method, an ``async def``, an async generator
      of ``owner`` (bases included) called with ``args`` positionally;
    - ``attribute``: an attribute ``owner`` assigns or declares; ``constant``: a module-level value;
    - ``keys``: dict keys ``kwargs`` that ``owner.name`` builds;
    - ``key_values``: dict literals of the module give key ``kwargs[0]`` each of ``values``;
    - ``tuple_first``: ``owner.name`` returns tuples whose first element is its parameter ``kwargs[0]``;
    - ``absent``: ``owner`` defines no ``name`` (a known upstream gap we rely on).
    """

    module: str  # dotted module inside the wheel, e.g. "sglang.srt.managers.io_struct"
    owner: str  # class name; "" for module level
    name: str
    kind: str
    args: tuple[str, ...] = ()
    kwargs: tuple[str, ...] = ()
    values: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    why: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Call {self.owner}.{self.name}: kind {self.kind!r} not in {KINDS}")


_ENGINE = "sglang.srt.entrypoints.engine"
_TM = "sglang.srt.managers.tokenizer_manager"
_IO = "sglang.srt.managers.io_struct"

ENGINE_KWARGS = tuple(
    "model_path tokenizer_path load_format enable_memory_saver enable_weights_cpu_backup mem_fraction_static "
    "tp_size max_total_tokens context_length max_running_requests random_seed log_level dtype "
    "json_model_override_args sleep_on_idle".split()
)
SAMPLING_KEYS = ("max_new_tokens", "temperature", "top_p", "stop_token_ids", "sampling_seed")


def _tm(name: str, kind: str, *args: str, **kw: Any) -> Call:
    """A ``TokenizerManager`` entry called with positional ``args``."""
    return Call(_TM, "TokenizerManager", name, kind, args=args, **kw)


def _io(name: str, *kwargs: str, **kw: Any) -> Call:
    """An ``io_struct`` request built with keywords ``kwargs``."""
    return Call(_IO, "", name, "kwargs", kwargs=kwargs, **kw)


def _tag(constant: str, value: str) -> Call:
    return Call("sglang.srt.constants", "", constant, "constant", values=(("value", (value,)),))


CALLS: dict[str, Call] = {
    # -- the engine object (this process) -------------------------------------------------------
    "Engine": Call(
        _ENGINE,
        "",
        "Engine",
        "kwargs",
        kwargs=ENGINE_KWARGS,
        values=(("load_format", ("dummy",)), ("dtype", ("float32", "bfloat16", "float16"))),
        why="started with dummy weights; every other argument a ServerArgs field",
    ),
    "Engine.tokenizer_manager": Call(_ENGINE, "Engine", "tokenizer_manager", "attribute"),
    "Engine.loop": Call(_ENGINE, "Engine", "loop", "attribute", why="run forever in our own thread"),
    "Engine._scheduler_init_result": Call(_ENGINE, "Engine", "_scheduler_init_result", "attribute"),
    "SchedulerInitResult": Call(_ENGINE, "SchedulerInitResult", "", "fields", kwargs=("scheduler_infos",)),
    "scheduler_info": Call(
        "sglang.srt.managers.scheduler",
        "Scheduler",
        "get_init_info",
        "keys",
        kwargs=("max_total_num_tokens",),
        why="the KV pool's token count (tag_bytes)",
    ),
    "Engine._serialize_tensors_per_rank": Call(
        _ENGINE, "Engine", "_serialize_tensors_per_rank", "method", args=("tensors", "load_format")
    ),
    "Engine.shutdown": Call(_ENGINE, "Engine", "shutdown", "method"),
    # -- tokenizer manager coroutines (submitted to Engine.loop) --------------------------------
    "generate_request": _tm("generate_request", "agen", "obj", "request"),
    "pause_generation": _tm("pause_generation", "coroutine", "obj"),
    "continue_generation": _tm("continue_generation", "coroutine", "obj"),
    "flush_cache": _tm("flush_cache", "coroutine"),
    "update_weights_from_tensor": _tm(
        "update_weights_from_tensor", "coroutine", "obj", "request", why="returns (success, message)"
    ),
    "get_weights_by_name": _tm("get_weights_by_name", "coroutine", "obj", "request"),
    "release_memory_occupation": _tm("release_memory_occupation", "coroutine", "obj", "request"),
    "resume_memory_occupation": _tm("resume_memory_occupation", "coroutine", "obj", "request"),
    # -- request objects ------------------------------------------------------------------------
    "GenerateReqInput": _io("GenerateReqInput", "input_ids", "sampling_params", "return_logprob"),
    "SamplingParams": Call(
        "sglang.srt.sampling.sampling_params",
        "",
        "SamplingParams",
        "kwargs",
        kwargs=SAMPLING_KEYS,
        why="the keys of GenerateReqInput.sampling_params",
    ),
    "PauseGenerationReqInput": _io(
        "PauseGenerationReqInput",
        "mode",
        values=(("mode", ("abort",)),),
        why="abort: requests in flight return; retract would keep them queued",
    ),
    "ContinueGenerationReqInput": _io("ContinueGenerationReqInput"),
    "UpdateWeightsFromTensorReqInput": _io(
        "UpdateWeightsFromTensorReqInput", "serialized_named_tensors", "load_format", "flush_cache"
    ),
    "GetWeightsByNameReqInput": _io("GetWeightsByNameReqInput", "name", "truncate_size"),
    "ReleaseMemoryOccupationReqInput": _io("ReleaseMemoryOccupationReqInput", "tags"),
    "ResumeMemoryOccupationReqInput": _io("ResumeMemoryOccupationReqInput", "tags"),
    "FlushCacheReqOutput": Call(
        _IO,
        "FlushCacheReqOutput",
        "",
        "fields",
        kwargs=("success", "message"),
        why="what flush_cache returns; success=False means nothing was flushed",
    ),
    # -- what generate_request yields -----------------------------------------------------------
    "generate_output": _tm(
        "_handle_batch_output", "keys", kwargs=("text", "output_ids", "meta_info", "finish_reason")
    ),
    "output_token_logprobs": _tm("add_logprob_to_meta_info", "keys", kwargs=("output_token_logprobs",)),
    "meta_info": _tm(
        "_handle_batch_output",
        "keys",
        kwargs=("cached_tokens",),
        why="prompt tokens the request read from the radix cache (GenerateOutput.cached_tokens)",
    ),
    "logprob_entry": _tm(
        "detokenize_logprob_tokens",
        "tuple_first",
        kwargs=("token_logprobs_val",),
        why="entry[0] is the log-prob",
    ),
    "finish_reason": Call(
        "sglang.srt.managers.schedule_batch",
        "",
        "to_json",
        "key_values",
        kwargs=("type",),
        values=(("type", ("stop", "length", "abort")),),
    ),
    # -- memory tags (torch_memory_saver regions inside the scheduler) --------------------------
    "TAG_WEIGHTS": _tag("GPU_MEMORY_TYPE_WEIGHTS", "weights"),
    "TAG_KV": _tag("GPU_MEMORY_TYPE_KV_CACHE", "kv_cache"),
    "TAG_CUDA_GRAPH": _tag("GPU_MEMORY_TYPE_CUDA_GRAPH", "cuda_graph"),
    # -- known gap: a Qwen3 engine cannot read its weights back ---------------------------------
    "qwen3_no_readback": Call(
        "sglang.srt.models.qwen3",
        "Qwen3ForCausalLM",
        "get_weights_by_name",
        "absent",
        why="get_weights_by_name returns None for Qwen3; weights_fingerprint raises",
    ),
}

# torch_memory_saver as backends/torch/memory.py uses it (the ``torch_memory_saver`` singleton).
_TMS = "torch_memory_saver.entrypoint"
TMS_CALLS: dict[str, Call] = {
    "singleton": Call("torch_memory_saver", "", "torch_memory_saver", "attribute"),
    "region": Call(_TMS, "TorchMemorySaver", "region", "method", kwargs=("tag", "enable_cpu_backup")),
    "pause": Call(_TMS, "TorchMemorySaver", "pause", "method", args=("tag",)),
    "resume": Call(_TMS, "TorchMemorySaver", "resume", "method", args=("tag",)),
    "hook_mode": Call(
        _TMS, "TorchMemorySaver", "hook_mode", "attribute", why="set to 'torch' before first use"
    ),
    "_impl": Call(_TMS, "TorchMemorySaver", "_impl", "attribute", why="None until first use"),
}


class UndeclaredCall(TypeError):
    """The adapter used something ``CALLS`` does not declare (fix the table, then the test checks it)."""


def _call(entry: str, *kinds: str) -> Call:
    c = CALLS.get(entry)
    if c is None or c.kind not in kinds:
        raise UndeclaredCall(
            f"sglang call {entry!r} is not declared as {'/'.join(kinds)} in sglang_calls.CALLS"
        )
    return c


def construct(module: Any, entry: str, **kwargs: Any) -> Any:
    """``module.<name>(**kwargs)`` for a ``kwargs`` entry; every keyword must be declared."""
    c = _call(entry, "kwargs")
    extra = sorted(set(kwargs) - set(c.kwargs))
    if extra:
        raise UndeclaredCall(f"{c.name}: keyword(s) {', '.join(extra)} not declared in sglang_calls.CALLS")
    return getattr(module, c.name)(**kwargs)


def invoke(obj: Any, entry: str, *args: Any) -> Any:
    """``obj.<name>(*args)`` for a method / coroutine / async generator entry (positional, as declared)."""
    c = _call(entry, "method", "coroutine", "agen")
    if len(args) != len(c.args):
        raise UndeclaredCall(f"{c.name}: {len(args)} argument(s), declared {c.args}")
    return getattr(obj, c.name)(*args)


def attr(obj: Any, entry: str) -> Any:
    """``obj.<name>`` for an ``attribute`` entry."""
    return getattr(obj, _call(entry, "attribute").name)


def key(entry: str, name: str) -> str:
    """A dict key we read from an upstream result (declared in ``entry``'s ``kwargs``)."""
    c = _call(entry, "keys", "fields")
    if name not in c.kwargs:
        raise UndeclaredCall(f"{entry}: key {name!r} not declared in sglang_calls.CALLS")
    return name


T = TypeVar("T")


def update_buckets(
    items: Iterable[tuple[str, T, int]], limit: int
) -> Iterator[tuple[list[tuple[str, T]], bool]]:
    """Group ``(name, tensor, nbytes)`` into the buckets of one ``update_weights_from_tensor`` call
    each: closed (``True``) once its bytes reach ``limit``; the rest last, open (``False``)."""
    bucket: list[tuple[str, T]] = []
    size = 0
    for name, t, nbytes in items:
        bucket.append((name, t))
        del t  # only the bucket holds it: a sent bucket frees its tensors
        size += nbytes
        if size >= limit:
            yield bucket, True
            bucket, size = [], 0
    if bucket:
        yield bucket, False

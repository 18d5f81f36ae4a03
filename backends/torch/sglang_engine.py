"""SGLang rollout engine adapter (CUDA): every SGLang touch-point of the torch backend lives here.

Written against **sglang 0.5.23** (the PyPI wheel ``sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl``,
read file by file: ``sglang/srt/entrypoints/engine.py``, ``managers/tokenizer_manager.py``,
``managers/tokenizer_control_mixin.py``, ``managers/io_struct.py``,
``managers/scheduler_components/weight_updater.py``,
``model_executor/model_runner_components/weight_updater.py`` and ``weight_exporter.py``,
``layers/sampler.py``, ``models/qwen3.py``). It has **not been run**: sglang needs CUDA and is
not installed where this was written; ``_probe_version`` fails loudly when an API it relies on
is missing. Facts it relies on (0.5.23):

- ``Engine(model_path, load_format="dummy", enable_memory_saver=True,
  enable_weights_cpu_backup, mem_fraction_static, tp_size, max_total_tokens, context_length,
  random_seed, dtype)`` runs the scheduler in subprocesses; the tokenizer manager lives in
  this process on ``engine.loop``.
- ``Engine.generate``/``flush_cache``/... call ``engine.loop.run_until_complete``, so a
  second thread cannot pause a running ``generate`` through them. This adapter runs
  ``engine.loop`` forever in its own thread and submits the tokenizer manager's coroutines
  (``generate_request``, ``pause_generation``, ``continue_generation``, ``flush_cache``,
  ``update_weights_from_tensor``, ``get_weights_by_name``, ``release/resume_memory_occupation``)
  with ``asyncio.run_coroutine_threadsafe``; ``Engine``'s own sync wrappers are not used
  after start. (Its tokenizer manager then installs no SIGTERM handler: that happens only
  when its loop is first used from the main thread.)
- ``pause_generation(PauseGenerationReqInput(mode="abort"))`` aborts every request in flight
  and returns once none is running; ``continue_generation`` lifts the pause.
- ``update_weights_from_tensor(UpdateWeightsFromTensorReqInput(serialized_named_tensors=one
  payload per TP rank, load_format=None, flush_cache))``: HF-named tensors go through the
  model's ``load_weights`` (fusing q/k/v and gate/up). CUDA tensors travel by IPC handle.
- Logprobs are ``log_softmax(logits / temperature)`` (``layers/sampler.py``, unless
  ``SGLANG_RETURN_ORIGINAL_LOGPROB``), the same definition as the embedded engine.
- Memory tags ``weights``, ``kv_cache``, ``cuda_graph`` (``sglang/srt/constants.py``),
  released through torch_memory_saver in the scheduler process.
- **Known gap**: ``get_weights_by_name`` reads through the model's own
  ``get_weights_by_name``; ``Qwen3ForCausalLM`` in 0.5.23 has none (``weight_exporter.py``:
  "TODO: Add support for Qwen models"), so the read-back returns ``None`` and
  ``weights_fingerprint`` raises: an update to a Qwen3 SGLang engine cannot be verified by
  this adapter with 0.5.23 (it fails loudly rather than skip the check).
"""

from __future__ import annotations

import asyncio
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from mllm_rl.backends.torch.engine import Placed, check_shape, tensor_sums
from mllm_rl.backends.torch.model import checkpoint_dtype, to_torch
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine import (
    ABORT,
    TAG_CUDA_GRAPH,
    TAG_KV,
    TAG_WEIGHTS,
    Fingerprint,
    GenerateOutput,
    SamplingParams,
    UpdateStats,
    request_seeds,
)
from mllm_rl.faults import fault

READ_VERSIONS = ("0.5.23",)  # read, never run (see the module docstring)
_TM_COROUTINES = ("generate_request", "pause_generation", "continue_generation", "flush_cache",
                  "update_weights_from_tensor", "get_weights_by_name", "release_memory_occupation",
                  "resume_memory_occupation")  # fmt: skip


def _probe_version() -> str:
    """The installed sglang version; RuntimeError when an API this adapter uses is missing."""
    import sglang
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    version = str(getattr(sglang, "__version__", "unknown"))
    for owner, attr in [
        (Engine, "_serialize_tensors_per_rank"),
        *((TokenizerManager, a) for a in _TM_COROUTINES),
    ]:
        if not hasattr(owner, attr):
            raise RuntimeError(
                f"sglang {version}: {owner.__name__}.{attr} missing; adapter written for {READ_VERSIONS}"
            )
    from sglang.srt.managers import io_struct

    for name in ("GenerateReqInput", "PauseGenerationReqInput", "ContinueGenerationReqInput",
                 "UpdateWeightsFromTensorReqInput", "GetWeightsByNameReqInput",
                 "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput"):  # fmt: skip
        if not hasattr(io_struct, name):
            raise RuntimeError(
                f"sglang {version}: io_struct.{name} missing; adapter written for {READ_VERSIONS}"
            )
    if version not in READ_VERSIONS:
        warnings.warn(f"sglang {version}: adapter written against {READ_VERSIONS}", stacklevel=2)
    return version


VERSION = _probe_version()  # import-time probe: importing this module fails loudly on a bad sglang


class SglangEngine:
    """An ``sglang.Engine`` started with dummy weights; implements ``EnginePrimitives``."""

    tags = (TAG_WEIGHTS, TAG_KV, TAG_CUDA_GRAPH)

    def __init__(
        self,
        model: ModelDir,
        tp: int = 1,
        max_total_tokens: int = 4096,
        context_length: int = 512,
        seed: int = 0,
        chunk_bytes: int = 64 * 2**20,
        weights_cpu_backup: bool = False,
        max_running_requests: int = 128,
        mem_fraction_static: float = 0.6,
        task: str | None = None,
        ports: list[int] | None = None,
    ) -> None:
        from sglang.srt.entrypoints.engine import Engine

        self.task = task
        # Multi-task runs: this engine's own ports (HTTP/scheduler port, and the nccl_port of its own
        # process group), bind-tested free by the run's allocator; SGLang would otherwise pick
        # "random + free?" and two engines started together can pick the same one.
        own_ports = {"port": ports[0], "nccl_port": ports[1]} if ports else {}

        self.model_dir = model
        self.dtype = checkpoint_dtype(model)
        self.bucket_bytes = max(chunk_bytes, 1)
        self.weights_cpu_backup = weights_cpu_backup
        self.engine = Engine(
            model_path=str(model.path), tokenizer_path=str(model.path), load_format="dummy",
            enable_memory_saver=True, enable_weights_cpu_backup=weights_cpu_backup,
            mem_fraction_static=mem_fraction_static, tp_size=tp, max_total_tokens=max_total_tokens,
            context_length=context_length, max_running_requests=max_running_requests, random_seed=seed,
            log_level="error", **own_ports,
            dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[self.dtype],
        )  # fmt: skip
        self.tm = self.engine.tokenizer_manager
        self.loop = self.engine.loop
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="sglang-loop", daemon=True)
        self._loop_thread.start()
        self.shapes = {n: info.shape for n, (_, info) in model.tensors.items()}
        self._graph_bytes = 0  # cuda_graph bytes, measured by mem_get_info at its last release
        self._paused = False  # set by pause_generation: errors of requests in flight then mean "aborted"

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    # -- weights ----------------------------------------------------------------------------
    def weight_names(self) -> list[str]:
        return list(self.shapes)

    def weight_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sum(int(torch.Size(s).numel()) * itemsize for s in self.shapes.values())

    def place(self, hf_name: str, value: Any) -> torch.Tensor:
        """``value`` as a new CUDA tensor in the engine dtype (the naive baseline's second copy)."""
        src = value if isinstance(value, torch.Tensor) else to_torch(value)
        check_shape(hf_name, src, self.shapes[hf_name])
        return src.to(device="cuda", dtype=self.dtype, copy=True)

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], on_tensor: Any = None) -> UpdateStats:
        """Stage tensors on CUDA in buckets of ~``chunk_bytes`` and send each bucket with
        ``update_weights_from_tensor`` (``flush_cache`` only with the last)."""
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput

        t0, noop = time.perf_counter(), fault("swap_noop")
        sums: dict[str, torch.Tensor] = {}
        bucket: list[tuple[str, torch.Tensor]] = []
        size = nbytes = 0

        def send(items: list[tuple[str, torch.Tensor]], flush: bool) -> None:
            if noop:
                return
            payload = self.engine._serialize_tensors_per_rank(items, None)
            req = UpdateWeightsFromTensorReqInput(
                serialized_named_tensors=payload, load_format=None, flush_cache=flush
            )
            ok, msg = self._call(self.tm.update_weights_from_tensor(req, None))
            if not ok:
                raise RuntimeError(f"sglang update_weights_from_tensor failed: {msg}")

        for name, value in named_tensors:
            t = value.tensor if isinstance(value, Placed) else self.place(name, value)
            sums[name] = tensor_sums(t)
            if on_tensor is not None:
                on_tensor(name)
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            nbytes += t.numel() * t.element_size()
            del t, value
            if size >= self.bucket_bytes:
                send(bucket, flush=False)
                bucket, size = [], 0
        if bucket:
            send(bucket, flush=True)
        else:
            self.flush_cache()
        fp: Fingerprint = {n: (float(s[0]), float(s[1])) for n, s in sums.items()}
        return UpdateStats(len(fp), nbytes, time.perf_counter() - t0, fp)

    def weights_fingerprint(self) -> Fingerprint:
        """(sum, sumsq) per weight, read back with ``get_weights_by_name`` (rank 0's view)."""
        from sglang.srt.managers.io_struct import GetWeightsByNameReqInput

        out: Fingerprint = {}
        for name, shape in self.shapes.items():
            req = GetWeightsByNameReqInput(name=name, truncate_size=int(shape[0]))
            values = self._call(self.tm.get_weights_by_name(req, None))
            if values is None:
                raise RuntimeError(f"sglang {VERSION}: get_weights_by_name({name!r}) returned None (this model "
                                   "has no read-back); the update cannot be verified")  # fmt: skip
            t = torch.tensor(values, dtype=torch.float32)
            s = tensor_sums(t)
            out[name] = (float(s[0]), float(s[1]))
        return out

    # -- generation -------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerateOutput]:
        """One request per prompt, submitted together; a request that SGLang ends with an error
        while generation is paused comes back as ``abort`` with no tokens; any other error is raised."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        params: dict[str, Any] = {"max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
                                  "top_p": sampling.top_p}  # fmt: skip
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        # a seed per request (the batch seed on all would make a GRPO group one sample); none: random
        seeds = request_seeds(sampling.seed, len(input_ids)) if sampling.seed is not None else None

        async def one(i: int, ids: list[int]) -> dict:
            req = params if seeds is None else {**params, "sampling_seed": seeds[i]}
            obj = GenerateReqInput(input_ids=ids, sampling_params=dict(req), return_logprob=True)
            return await self.tm.generate_request(obj, None).__anext__()

        async def all_of() -> list[Any]:
            return await asyncio.gather(
                *(one(i, [int(t) for t in p]) for i, p in enumerate(input_ids)), return_exceptions=True
            )

        outs = []
        for o in self._call(all_of()):
            if isinstance(o, BaseException):
                if not self._paused:  # a real failure, not a request cut short by a drain
                    raise o
                outs.append(GenerateOutput([], [], "", ABORT))
                continue
            meta = o["meta_info"]
            reason = (meta.get("finish_reason") or {}).get("type") or ABORT
            outs.append(GenerateOutput([int(t) for t in o["output_ids"]],
                                       [float(x[0]) for x in meta.get("output_token_logprobs") or []],
                                       o.get("text", ""), reason))  # fmt: skip
        return outs

    def pause_generation(self) -> None:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        self._paused = True
        self._call(self.tm.pause_generation(PauseGenerationReqInput(mode="abort")))

    def continue_generation(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        self._call(self.tm.continue_generation(ContinueGenerationReqInput()))
        self._paused = False

    def flush_cache(self) -> None:
        self._call(self.tm.flush_cache())

    # -- memory tags ------------------------------------------------------------------------
    def memory_tag(self, tag: str) -> str:
        """``<task>/<tag>`` in records: SGLang's torch_memory_saver tags live in this engine's
        own scheduler process(es), so its release names only its own bytes."""
        return f"{self.task}/{tag}" if self.task else tag

    def tag_bytes(self, tag: str) -> int:
        """weights: checkpoint bytes in the engine dtype; kv_cache: SGLang's token pool size x
        bytes per token; cuda_graph: the device bytes its last release freed (0 before one)."""
        if tag == TAG_WEIGHTS:
            return self.weight_bytes()
        if tag == TAG_KV:
            c = self.model_dir.config
            info = self.engine._scheduler_init_result.scheduler_infos[0]
            per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim
            return (
                int(info["max_total_num_tokens"])
                * per_token
                * torch.empty((), dtype=self.dtype).element_size()
            )
        return self._graph_bytes

    def release_memory(self, tag: str) -> None:
        from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput

        free0 = torch.cuda.mem_get_info()[0]
        self._call(self.tm.release_memory_occupation(ReleaseMemoryOccupationReqInput(tags=[tag]), None))
        if tag == TAG_CUDA_GRAPH:
            self._graph_bytes = max(0, int(torch.cuda.mem_get_info()[0] - free0))

    def resume_memory(self, tag: str) -> bool:
        from sglang.srt.managers.io_struct import ResumeMemoryOccupationReqInput

        self._call(self.tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(tags=[tag]), None))
        return tag == TAG_WEIGHTS and self.weights_cpu_backup

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)

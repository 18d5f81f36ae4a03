"""SGLang rollout engine adapter (CUDA); every SGLang call goes through ``sglang_calls.py``.

Written against sglang 0.5.23's wheel source (``tests/torch/test_sglang_conformance.py`` checks
the table against it and drives this adapter against a fake); ``_probe_version`` fails at import
when a declared API is missing. The tokenizer manager runs on ``engine.loop`` in its own thread
here (another thread can pause a running ``generate``); ``flush_cache`` may report failure without
raising, so it is retried; Qwen3 has no ``get_weights_by_name``, so ``weights_fingerprint`` raises.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from mllm_rl.backends.torch import sglang_calls as sc
from mllm_rl.backends.torch.engine import check_shape, read_sums, tensor_sums
from mllm_rl.backends.torch.model import checkpoint_dtype, to_torch
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine import (
    ABORT,
    TAG_CUDA_GRAPH,
    TAG_KV,
    TAG_WEIGHTS,
    Fingerprint,
    GenerateOutput,
    Placed,
    SamplingParams,
    UpdateStats,
    request_seeds,
)
from mllm_rl.faults import fault

READ_VERSIONS = (sc.SGLANG_VERSION,)  # read, never run (see the module docstring)
_CHECKED_AT_IMPORT = ("kwargs", "method", "coroutine", "agen", "constant")


def _probe_version() -> str:
    """The installed sglang version; RuntimeError naming the first declared call it lacks."""
    import importlib

    import sglang

    version = str(getattr(sglang, "__version__", "unknown"))
    for k, c in sc.CALLS.items():
        if c.kind not in _CHECKED_AT_IMPORT:
            continue  # attributes set in __init__, output keys: checked against the wheel by the test
        mod = importlib.import_module(c.module)
        owner = getattr(mod, c.owner, None) if c.owner else mod
        if owner is None or not hasattr(owner, c.name):
            where = f"{c.module}.{c.owner + '.' if c.owner else ''}{c.name}"
            raise RuntimeError(
                f"sglang {version}: {where} missing (sglang_calls.CALLS[{k!r}]); adapter written "
                f"for {READ_VERSIONS}"
            )
        if c.kind == "constant" and getattr(owner, c.name) != dict(c.values)["value"][0]:
            raise RuntimeError(
                f"sglang {version}: {c.module}.{c.name} = {getattr(owner, c.name)!r}, "
                f"expected {dict(c.values)['value'][0]!r}"
            )
    if version not in READ_VERSIONS:
        warnings.warn(f"sglang {version}: adapter written against {READ_VERSIONS}", stacklevel=2)
    return version


VERSION = _probe_version()  # import-time probe: importing this module fails loudly on a bad sglang


class SglangEngine:
    """An ``sglang.Engine`` started with dummy weights; implements ``EnginePrimitives``."""

    tags = (TAG_WEIGHTS, TAG_KV, TAG_CUDA_GRAPH)
    device = torch.device("cuda")  # where update tensors are staged (IPC handles need CUDA tensors)

    def __init__(
        self,
        model: ModelDir,
        tp: int = 1,
        max_total_tokens: int = 4096,
        context_length: int = 512,
        seed: int = 0,
        chunk_bytes: int = sc.CHUNK_BYTES,
        weights_cpu_backup: bool = False,
        max_running_requests: int = sc.MAX_RUNNING_REQUESTS,
        mem_fraction_static: float = sc.MEM_FRACTION_STATIC,
        task: str | None = None,
        ports: list[int] | None = None,
    ) -> None:
        from sglang.srt.entrypoints import engine as engine_mod

        self.task = task
        # multi-task runs: ports the run's allocator tested free (SGLang's own pick can collide)
        own_ports = {"port": ports[0], "nccl_port": ports[1]} if ports else {}
        self.model_dir = model
        self.dtype = checkpoint_dtype(model)
        self.bucket_bytes = max(chunk_bytes, 1)
        self.weights_cpu_backup = weights_cpu_backup
        self.engine = sc.construct(
            engine_mod,
            "Engine",
            model_path=str(model.path),
            tokenizer_path=str(model.path),
            load_format="dummy",
            enable_memory_saver=True,
            enable_weights_cpu_backup=weights_cpu_backup,
            mem_fraction_static=mem_fraction_static,
            tp_size=tp,
            max_total_tokens=max_total_tokens,
            context_length=context_length,
            max_running_requests=max_running_requests,
            random_seed=seed,
            log_level="error",
            **own_ports,
            sleep_on_idle=True,  # else an idle scheduler busy-polls a host core per TP rank
            # SGLang reads config.json with its own transformers: hand it the config the trainer uses
            json_model_override_args=json.dumps(model.config.hf_architecture()),
            dtype=str(self.dtype).removeprefix("torch."),  # float32, bfloat16 or float16
        )
        self.tm = sc.attr(self.engine, "Engine.tokenizer_manager")
        self.loop = sc.attr(self.engine, "Engine.loop")
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="sglang-loop", daemon=True)
        self._loop_thread.start()
        self.shapes = {n: info.shape for n, (_, info) in model.tensors.items()}
        self._graph_bytes = 0  # cuda_graph bytes, measured by mem_get_info at its last release
        self._paused = False  # set by pause_generation: errors of requests in flight then mean "aborted"

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @staticmethod
    def _io() -> Any:
        from sglang.srt.managers import io_struct

        return io_struct

    # -- weights ----------------------------------------------------------------------------
    def weight_names(self) -> list[str]:
        return list(self.shapes)

    def weight_bytes(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return sum(int(torch.Size(s).numel()) * itemsize for s in self.shapes.values())

    def place(self, hf_name: str, value: Any) -> torch.Tensor:
        """``value`` as a new tensor on ``self.device`` in the engine dtype (an update's staging copy)."""
        src = value if isinstance(value, torch.Tensor) else to_torch(value)
        check_shape(hf_name, src, self.shapes[hf_name])
        return src.to(device=self.device, dtype=self.dtype, copy=True)

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], on_tensor: Any = None) -> UpdateStats:
        """Stage tensors on the device in buckets of ~``chunk_bytes`` (``sc.update_buckets``) and
        send each bucket with ``update_weights_from_tensor`` (``flush_cache`` only with the last)."""
        t0, noop = time.perf_counter(), fault("swap_noop")
        sums: dict[str, torch.Tensor] = {}
        nbytes = 0

        def staged() -> Iterator[tuple[str, torch.Tensor, int]]:
            nonlocal nbytes
            for name, value in named_tensors:
                t = value.value if isinstance(value, Placed) else self.place(name, value)
                sums[name] = tensor_sums(t)
                n = t.numel() * t.element_size()
                if on_tensor is not None:
                    on_tensor(name, n)
                nbytes += n
                del value
                yield name, t, n
                del t  # the bucket holds it until sent; nothing else does

        def send(items: list[tuple[str, torch.Tensor]], flush: bool) -> None:
            if noop:
                return
            payload = sc.invoke(self.engine, "Engine._serialize_tensors_per_rank", items, None)
            req = sc.construct(
                self._io(),
                "UpdateWeightsFromTensorReqInput",
                serialized_named_tensors=payload,
                load_format=None,
                flush_cache=flush,
            )
            ok, msg = self._call(sc.invoke(self.tm, "update_weights_from_tensor", req, None))
            if not ok:
                raise RuntimeError(f"sglang update_weights_from_tensor failed: {msg}")

        last_open = False
        for bucket, closed in sc.update_buckets(staged(), self.bucket_bytes):
            send(bucket, flush=not closed)
            last_open = not closed
            del bucket
        if not last_open:  # every bucket was sent full (or none): flush on its own
            self.flush_cache()
        fp = read_sums(sums)
        return UpdateStats(len(fp), nbytes, time.perf_counter() - t0, fp)

    def weights_fingerprint(self, names: Sequence[str] | None = None) -> Fingerprint:
        """(sum, sumsq) per weight (``names``: those), read back with ``get_weights_by_name``."""
        sums: dict[str, torch.Tensor] = {}
        for name in self.shapes if names is None else names:
            shape = self.shapes[name]
            req = sc.construct(self._io(), "GetWeightsByNameReqInput", name=name, truncate_size=int(shape[0]))
            values = self._call(sc.invoke(self.tm, "get_weights_by_name", req, None))
            if values is None:
                raise RuntimeError(
                    f"sglang {VERSION}: get_weights_by_name({name!r}) returned None (this model "
                    "has no read-back); the update cannot be verified"
                )
            sums[name] = tensor_sums(torch.tensor(values, dtype=torch.float32))
        return read_sums(sums)

    # -- generation -------------------------------------------------------------------------
    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerateOutput]:
        """One request per prompt, submitted together; an error while paused comes back as ``abort``."""
        params = sampling.server_params()
        # a seed per request (the batch seed on all would make a GRPO group one sample); none: random
        seeds = None
        if sampling.seed is not None:
            seeds = request_seeds(sampling.seed, len(input_ids), sampling.request_offset)
        undeclared = (set(params) | {"sampling_seed"}) - set(sc.CALLS["SamplingParams"].kwargs)
        if undeclared:
            raise sc.UndeclaredCall(f"sampling_params key(s) {sorted(undeclared)} not declared")
        io = self._io()

        async def one(i: int, ids: list[int]) -> dict:
            req = params if seeds is None else {**params, "sampling_seed": seeds[i]}
            obj = sc.construct(
                io, "GenerateReqInput", input_ids=ids, sampling_params=dict(req), return_logprob=True
            )
            return await sc.invoke(self.tm, "generate_request", obj, None).__anext__()

        async def all_of() -> list[Any]:
            return await asyncio.gather(
                *(one(i, [int(t) for t in p]) for i, p in enumerate(input_ids)), return_exceptions=True
            )

        k = sc.key
        outs = []
        for o in self._call(all_of()):
            if isinstance(o, BaseException):
                if not self._paused:  # a real failure, not a request cut short by a drain
                    raise o
                outs.append(GenerateOutput([], [], "", ABORT))
                continue
            meta = o[k("generate_output", "meta_info")]
            reason = (meta.get(k("generate_output", "finish_reason")) or {}).get("type") or ABORT
            lps = meta.get(k("output_token_logprobs", "output_token_logprobs")) or []
            outs.append(
                GenerateOutput(
                    [int(t) for t in o[k("generate_output", "output_ids")]],
                    [float(x[0]) for x in lps],  # entry: (logprob, token_id, text)
                    o.get(k("generate_output", "text")) or "",
                    reason,
                    int(meta.get(k("meta_info", "cached_tokens")) or 0),
                )
            )
        return outs

    def pause_generation(self) -> None:
        self._paused = True
        req = sc.construct(self._io(), "PauseGenerationReqInput", mode="abort")
        self._call(sc.invoke(self.tm, "pause_generation", req))

    def continue_generation(self) -> None:
        req = sc.construct(self._io(), "ContinueGenerationReqInput")
        self._call(sc.invoke(self.tm, "continue_generation", req))
        self._paused = False

    def flush_cache(self, timeout_s: float = 60.0) -> None:
        """``flush_cache`` until it reports success; RuntimeError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            out = self._call(sc.invoke(self.tm, "flush_cache"))
            if getattr(out, sc.key("FlushCacheReqOutput", "success")):
                return
            if time.monotonic() > deadline:
                msg = getattr(out, sc.key("FlushCacheReqOutput", "message"))
                raise RuntimeError(f"sglang flush_cache did not succeed within {timeout_s}s: {msg}")
            time.sleep(0.05)

    # -- memory tags ------------------------------------------------------------------------
    def memory_tag(self, tag: str) -> str:
        """``<task>/<tag>`` in records (its scheduler processes hold only its own bytes)."""
        return f"{self.task}/{tag}" if self.task else tag

    def tag_bytes(self, tag: str) -> int:
        """weights: checkpoint bytes; kv_cache: pool tokens x bytes/token; cuda_graph: its last release."""
        if tag == TAG_WEIGHTS:
            return self.weight_bytes()
        if tag == TAG_KV:
            c = self.model_dir.config
            result = sc.attr(self.engine, "Engine._scheduler_init_result")
            info = getattr(result, sc.key("SchedulerInitResult", "scheduler_infos"))[0]
            per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim
            tokens = int(info[sc.key("scheduler_info", "max_total_num_tokens")])
            return tokens * per_token * torch.empty((), dtype=self.dtype).element_size()
        return self._graph_bytes

    def _free_bytes(self) -> int:
        return int(torch.cuda.mem_get_info()[0])

    def release_memory(self, tag: str) -> None:
        free0 = self._free_bytes()
        req = sc.construct(self._io(), "ReleaseMemoryOccupationReqInput", tags=[tag])
        self._call(sc.invoke(self.tm, "release_memory_occupation", req, None))
        if tag == TAG_CUDA_GRAPH:
            self._graph_bytes = max(0, self._free_bytes() - free0)

    def resume_memory(self, tag: str) -> bool:
        req = sc.construct(self._io(), "ResumeMemoryOccupationReqInput", tags=[tag])
        self._call(sc.invoke(self.tm, "resume_memory_occupation", req, None))
        return tag == TAG_WEIGHTS and self.weights_cpu_backup

    def shutdown(self) -> None:
        sc.invoke(self.engine, "Engine.shutdown")
        self.loop.call_soon_threadsafe(self.loop.stop)

"""sglang-jax rollout engine adapter: every private touch-point of sglang-jax lives here
(weight placement and fingerprints: ``engine_weights.py``). Verified against sglang-jax 0.1.0rc0:

- ``Engine(enable_single_process=True, load_format="dummy")`` runs in-process.
- No weight-update API: the jitted forward reads ``model_runner.model_state_leaves`` on every call,
  so replacing items with same shape/dtype/sharding arrays swaps weights without recompiling.
- CPU: ``head_dim`` a multiple of 128; ``jax.device_put`` of a numpy view aliases it.
- Interpreter teardown after an engine ran aborts in C++, so the CLI leaves through ``os._exit``.
- Multi-process (docs/TPU.md): one engine over every process's devices; node 0 tokenizes and
  broadcasts each iteration's requests.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from mllm_rl.backends.jax import distributed as dist
from mllm_rl.backends.jax.engine_layout import DEFAULT_MEM_FRACTION, attention_backend
from mllm_rl.backends.jax.engine_watch import EngineThreadError, ThreadWatch, own_sigquit
from mllm_rl.backends.jax.engine_weights import EngineLeaves, dotted, host_copy, zeros
from mllm_rl.backends.jax.fingerprint import read_sums
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine import (
    ABORT,
    TAG_KV,
    TAG_WEIGHTS,
    Fingerprint,
    GenerateOutput,
    SamplingParams,
    UpdateStats,
    request_seeds,
)
from mllm_rl.faults import fault

__all__ = ["EngineConfigError", "SglangJaxEngine", "host_copy", "validate_engine_args"]

VERIFIED_VERSIONS = ("0.1.0rc0",)
PAUSE_TIMEOUT_S = 120.0  # pause_generation: longer means a request the pause cannot abort
IDLE_POLL_MS = 50  # an idle scheduler waits this long for a message (it wakes at once on one)
WATCH_S = 0.5  # a call waiting on the engine looks this often whether its threads still run
# Emitted by sglang-jax's scheduler/tokenizer threads for every hand-made tokenizer.
warnings.filterwarnings("ignore", message="Created patched tokenizer config workaround")


class EngineConfigError(ValueError):
    """Engine arguments that would make sglang-jax fail (validated before it starts)."""


def _check_version() -> str:
    import sgl_jax
    from sgl_jax.srt.entrypoints import engine as engine_mod
    from sgl_jax.srt.entrypoints.engine import Engine
    from sgl_jax.srt.managers.scheduler import Scheduler
    from sgl_jax.srt.managers.tokenizer_manager import ReqState
    from sgl_jax.srt.models.qwen3 import Qwen3ForCausalLM

    version = getattr(sgl_jax, "__version__", None) or sgl_jax.version.__version__
    needed = {  # what this adapter calls or wraps
        "Engine": (Engine, ("generate", "pause_generation", "flush_cache")),
        "Qwen3ForCausalLM": (Qwen3ForCausalLM, ("_create_qwen3_weight_mappings",)),
        "Scheduler": (Scheduler, ("on_idle", "is_fully_idle")),
        "engine": (engine_mod, ("run_scheduler_loop_thread_after_create",)),
    }
    missing = [
        f"{name}.{a}" for name, (owner, attrs) in needed.items() for a in attrs if not hasattr(owner, a)
    ]
    if "finished" not in {f.name for f in dataclasses.fields(ReqState)}:  # _pause_reaping reads it
        missing.append("ReqState.finished")
    if missing:
        raise RuntimeError(
            f"sglang-jax {version}: {missing[0]} missing; adapter verified on {VERIFIED_VERSIONS}"
        )
    if version not in VERIFIED_VERSIONS:
        warnings.warn(f"sglang-jax {version} is not a verified version {VERIFIED_VERSIONS}", stacklevel=2)
    return version


def validate_engine_args(model: ModelDir, tp: int, n_devices: int, n_processes: int = 1) -> None:
    """``n_devices``: ``len(jax.devices())`` (every process's devices in a multi-process run)."""
    cfg = model.config
    if n_processes > 1 and tp != n_devices:
        raise EngineConfigError(
            f"--tp {tp}: across {n_processes} processes the engine's mesh spans every device "
            f"(sglang-jax multi-node); pass --tp {n_devices}"
        )
    if tp < 1 or tp > n_devices:
        raise EngineConfigError(f"--tp {tp}: {n_devices} local device(s) available")
    model.check_tp(tp)  # ValueError naming config.json
    if cfg.head_dim % 128:
        raise EngineConfigError(
            f"{model.path / 'config.json'}: head_dim {cfg.head_dim} must be a multiple of 128 for sglang-jax"
        )


class SglangJaxEngine:
    """An in-process sglang-jax Engine started with dummy weights: ``mllm_rl.engine.EnginePrimitives``
    (lifecycle state lives in the core's ``ManagedEngine``)."""

    tags = (TAG_WEIGHTS, TAG_KV)

    def __init__(
        self,
        model: ModelDir,
        tp: int = 1,
        max_total_tokens: int = 4096,
        context_length: int = 512,
        max_running_requests: int = 16,
        mem_fraction_static: float | None = None,
        seed: int = 0,
        chunk_bytes: int = 64 * 2**20,
        weights_cpu_backup: bool = False,
        task: str | None = None,
        ports: Sequence[int] | None = None,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.task = task  # multi-task runs: its memory tags are <task>/weights, <task>/kv_cache
        self.version = _check_version()
        self.procs = dist.procs()
        validate_engine_args(model, tp, len(jax.devices()), self.procs.count)
        from sgl_jax.srt.entrypoints.engine import Engine

        platform = jax.devices()[0].platform
        st_dtype = next(iter(model.tensors.values()))[1].dtype  # the checkpoint's
        self.model = model
        prev_sigterm = signal.getsignal(signal.SIGTERM)
        multi: dict[str, Any] = {}
        if self.procs.count > 1:  # one engine over every process's devices (sglang-jax multi-node)
            addr = dist.engine_address(ports[0] if ports else None)
            multi = dict(nnodes=self.procs.count, node_rank=self.procs.index, dist_init_addr=addr)
        launch = _launched_scheduler() if multi else contextlib.nullcontext({})
        before = set(threading.enumerate())
        with launch as launched:
            self.engine = Engine(
                **multi,
                model_path=str(model.path),
                tokenizer_path=str(model.path),
                # sglang-jax's transformers (4.57) knows no ``rope_parameters`` and would build RoPE
                # with base 10000: every field that decides the computation comes from our config
                json_model_override_args=json.dumps(model.config.hf_architecture()),
                load_format="dummy",
                enable_single_process=True,
                device=platform,
                attention_backend=attention_backend(platform, jax.devices()[0].device_kind),
                tp_size=tp,
                dtype={"F32": "float32", "BF16": "bfloat16", "F16": "float16"}[st_dtype],
                mem_fraction_static=mem_fraction_static or DEFAULT_MEM_FRACTION[platform],
                max_total_tokens=max_total_tokens,
                context_length=context_length,
                max_running_requests=max_running_requests,
                disable_precompile=True,
                skip_server_warmup=True,
                grammar_backend="none",
                random_seed=seed,
                log_level="error",
                # the loop in a daemon thread, every call through ``_call``: a pause from one thread
                # aborts another's requests (nodes >= 1 have no tokenizer manager, nor loop)
                enable_engine_loop_run_forever_daemon=self.procs.index == 0,
                # per-request ``sampling_seed`` needs this (``_generate_here`` always sets one)
                enable_deterministic_sampling=True,
                # the overlap thread rewrites host buffers a running forward may still read: wrong
                # tokens on CPU, CUDA_ERROR_ILLEGAL_INSTRUCTION on a GPU (docs/ENGINES.md)
                disable_overlap_schedule=platform != "tpu",
            )
        # The tokenizer manager's SIGTERM handler only sets a flag: give SIGTERM back to the process
        on_main = threading.current_thread() is threading.main_thread()
        if on_main and self.engine.tokenizer_manager is not None:
            self.engine.tokenizer_manager.auto_create_handle_loop()
            self.engine.loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, prev_sigterm)
        scheduler = (self.engine.scheduler_info or launched)["scheduler"]
        self.watch = ThreadWatch(ThreadWatch.started_since(before))
        if on_main and self.engine.tokenizer_manager is not None:
            own_sigquit(self.engine.loop, scheduler)
        if self.procs.index == 0:  # nodes >= 1 wait in their subscriber's blocking recv
            _sleep_when_idle(scheduler)
        self.runner = scheduler.tp_worker.worker.model_runner
        self._index_leaves()
        self.weights_cpu_backup = weights_cpu_backup
        self._kv_specs: list[tuple[tuple[int, ...], Any, Any]] = []
        self._weight_backup: dict[int, list[tuple[Any, np.ndarray]]] = {}  # leaf -> (device, shard)
        self._seeds = np.random.default_rng(seed)  # request seeds when a batch brings none

    def _index_leaves(self) -> None:
        from flax import nnx

        model = self.runner.model
        _, state = nnx.split(model)
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        leaves = self.runner.model_state_leaves
        if len(flat) != len(leaves) or any(a is not b for (_, a), b in zip(flat, leaves, strict=True)):
            raise RuntimeError(
                "sglang-jax model_state_leaves no longer mirror nnx.split(model); adapter outdated"
            )
        by_path = {dotted(p): i for i, (p, _) in enumerate(flat)}
        mappings: dict[str, tuple[int, bool]] = {}
        for hf_name, m in model._create_qwen3_weight_mappings().items():
            target = m.target_path if isinstance(m.target_path, str) else None
            if target is None or target not in by_path or m.reshape or m.repeat or m.transpose_axes:
                raise RuntimeError(f"sglang-jax mapping for {hf_name} is not a plain copy/transpose")
            mappings[hf_name] = (by_path[target], bool(m.transpose))
        # the jitted forward reads ``model_state_leaves`` on every call: items replaced there count
        self.weights = EngineLeaves(lambda: self.runner.model_state_leaves, mappings, self.chunk_bytes)
        self.mappings = self.weights.mappings  # HF name -> (leaf index, transpose)
        self._state_def = jax.tree_util.tree_structure(state)

    # -- weights --------------------------------------------------------------
    def place(self, hf_name: str, value: Any) -> jax.Array:
        """``value`` on the engine's devices in the engine layout (``EngineLeaves.place``)."""
        return self.weights.place(hf_name, value)

    def _resync_module(self) -> None:
        """Point the nnx module's variables at the installed leaves (frees nothing, copies nothing)."""
        from flax import nnx

        nnx.update(
            self.runner.model, jax.tree_util.tree_unflatten(self._state_def, self.runner.model_state_leaves)
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], on_tensor: Any = None) -> UpdateStats:
        """Streaming update: per tensor, place it, fingerprint it, install it, drop the old leaf.

        Values: a host ndarray or jax.Array in HF layout, a ``KernelInOut`` ``[in, out]``, or a
        ``Placed`` array in the engine layout. ``installed``: the tensors whose summed array is the
        leaf the forward reads, on every process."""
        t0 = time.perf_counter()
        sums, nbytes, summed = self.weights.stream(named_tensors, on_tensor)
        self._resync_module()
        jax.block_until_ready(self.runner.model_state_leaves)
        fp = read_sums(sums)
        installed = self.weights.installed(summed)
        del summed
        if self.procs.count > 1:
            for other in dist.gather("update/installed", json.dumps(sorted(installed))):
                installed &= frozenset(json.loads(other))
        return UpdateStats(len(fp), nbytes, time.perf_counter() - t0, fp, installed=installed)

    def weights_fingerprint(self, names: Sequence[str] | None = None) -> Fingerprint:
        """(sum, sum of squares) of every mapped leaf (``names``: those) the forward uses."""
        return self.weights.fingerprint(names)

    def weight_names(self) -> list[str]:
        return self.weights.names()

    def weight_bytes(self) -> int:
        return sum(int(a.nbytes) for a in self.weights.arrays())

    # -- generation -----------------------------------------------------------
    def generate(self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams) -> list[GenerateOutput]:
        """Multi-process: every process calls it; node 0 submits the requests and shares the outputs."""
        if self.procs.count == 1:
            return self._generate_here(input_ids, sampling)
        dist.barrier("generate")  # the forward over the multi-process mesh runs in lockstep
        if self.procs.index == 0:
            try:
                outs = self._generate_here(input_ids, sampling)
            except BaseException as e:  # the others would wait for outputs that never come
                dist.share("generate", json.dumps({"error": f"{type(e).__name__}: {e}"}))
                raise
            dist.share("generate", json.dumps({"outputs": [dataclasses.asdict(o) for o in outs]}))
            return outs
        msg = json.loads(dist.share("generate", None))
        if "error" in msg:
            raise RuntimeError(f"generate failed on process 0: {msg['error']}")
        return [GenerateOutput(**o) for o in msg["outputs"]]

    def _generate_here(
        self, input_ids: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[GenerateOutput]:
        params = sampling.server_params()
        ids = [list(map(int, x)) for x in input_ids]
        base = sampling.seed if sampling.seed is not None else int(self._seeds.integers(2**31))
        per_req = [
            {**params, "sampling_seed": s} for s in request_seeds(base, len(ids), sampling.request_offset)
        ]
        out = self._call(self._send(ids, per_req))
        if out is None:  # paused before the batch was sent: what a pause does to queued requests
            return [GenerateOutput([], [], "", ABORT) for _ in ids]
        outs = out if isinstance(out, list) else [out]
        results = []
        for o in outs:
            meta = o["meta_info"]
            # (logprob, token_id, text) per token; not output_ids, which drop the EOS. sglang-jax
            # appends the cumulative list again every 50 tokens: the completion is the last n.
            lp = meta.get("output_token_logprobs") or []
            n = int(meta.get("completion_tokens") or len(lp))
            if len(lp) < n:
                raise RuntimeError(f"sglang-jax returned {n} completion tokens but {len(lp)} logprobs")
            lp = lp[len(lp) - n :]
            results.append(
                GenerateOutput(
                    token_ids=[int(x[1]) for x in lp],
                    logprobs=[float(x[0]) for x in lp],
                    text=o["text"],
                    finish_reason=str((meta.get("finish_reason") or {}).get("type")),
                    cached_tokens=int(meta.get("cached_tokens") or 0),
                )
            )
        return results

    async def _send(self, ids: list[list[int]], per_req: list[dict[str, Any]]) -> Any:
        """The batch on the engine's loop, after 0-token requests for each prompt sent more than
        once (else a GRPO group's prompt is prefilled once per sample). None when a pause came
        first (a request sent while paused would wait for ``continue_generation``)."""
        tm = self.engine.tokenizer_manager
        counts = collections.Counter(map(tuple, ids))
        shared = [list(p) for p, n in counts.items() if n > 1]
        if shared and not getattr(self.engine.server_args, "disable_radix_cache", False):
            if tm.is_pause:
                return None
            await self.engine.async_generate(input_ids=shared, sampling_params={"max_new_tokens": 0})
        if tm.is_pause:
            return None
        return await self.engine.async_generate(input_ids=ids, sampling_params=per_req, return_logprob=True)

    # -- memory tags ----------------------------------------------------------
    def memory_tag(self, tag: str) -> str:
        """``tag``'s name in records: ``<task>/<tag>`` for a task's engine."""
        return f"{self.task}/{tag}" if self.task else tag

    def _kv_list(self) -> list[jax.Array]:
        return self.runner.memory_pools.token_to_kv_pool.kv_buffer

    def tag_bytes(self, tag: str) -> int:
        """Device bytes a resident tag holds (over all local devices)."""
        arrs = self._kv_list() if tag == TAG_KV else self.weights.arrays()
        return sum(int(a.nbytes) for a in arrs if not a.is_deleted())

    def release_memory(self, tag: str) -> None:
        """Delete the arrays of ``tag`` (weights first copied to host with ``weights_cpu_backup``)."""
        if tag == TAG_KV:
            kv = self._kv_list()
            self._kv_specs = [(a.shape, a.dtype, a.sharding) for a in kv]
            for a in kv:
                a.delete()
            return
        leaves = self.runner.model_state_leaves
        for i, _ in self.mappings.values():
            if self.weights_cpu_backup and not fault("resume_lies"):  # the fault: backup lost
                self._weight_backup[i] = [  # this process's shards
                    (sh.device, np.asarray(sh.data)) for sh in leaves[i].addressable_shards
                ]
            leaves[i].delete()

    def resume_memory(self, tag: str) -> bool:
        """Reallocate ``tag`` as it was; weights from the CPU backup (True) or zeros (False)."""
        if tag == TAG_KV:
            kv = self._kv_list()
            for j, (shape, dtype, sharding) in enumerate(self._kv_specs):
                kv[j] = zeros(shape, dtype, sharding)
            return True
        leaves = self.runner.model_state_leaves
        restored = True
        for i, _ in self.mappings.values():
            old = leaves[i]
            if i in self._weight_backup:
                shards = [jax.device_put(a, d) for d, a in self._weight_backup.pop(i)]
                leaves[i] = jax.make_array_from_single_device_arrays(old.shape, old.sharding, shards)
            else:
                leaves[i] = zeros(old.shape, old.dtype, old.sharding)
                restored = False
        self._resync_module()
        return restored or fault("resume_lies")

    def _call(self, coro: Any, timeout_s: float | None = None) -> Any:
        """Run ``coro`` on the engine's loop and wait (past ``timeout_s``: cancelled, TimeoutError;
        an engine thread ended: cancelled, ``EngineThreadError`` naming its error)."""
        fut = asyncio.run_coroutine_threadsafe(coro, self.engine.loop)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = WATCH_S if deadline is None else max(0.0, min(WATCH_S, deadline - time.monotonic()))
            try:
                return fut.result(timeout=left)
            except TimeoutError:
                try:
                    self.watch.check()
                except EngineThreadError:
                    fut.cancel()
                    raise
                if deadline is not None and time.monotonic() >= deadline:
                    fut.cancel()
                    raise

    def flush_cache(self, timeout_s: float = 60.0) -> None:
        """Flush the radix cache and KV allocator, retrying: sglang-jax refuses (``success=False``)
        while its scheduler holds a returned request's last batch, and stale prefixes would point
        into KV slots a release/resume zeroes."""
        self._on_node_0("flush_cache", lambda: self._flush_here(timeout_s))

    def _flush_here(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            out = self._call(self.engine.async_flush_cache())
            if getattr(out, "success", True):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"sglang-jax flush_cache did not succeed within {timeout_s}s: {out.error_msg}"
                )
            time.sleep(0.005)

    def pause_generation(self, timeout_s: float = PAUSE_TIMEOUT_S) -> None:
        """Requests in flight return with finish_reason "abort" (the default "retract" keeps them
        queued). A request aborted before prefill stays in ``rid_to_state``, which the pause waits to
        empty: ``_pause_reaping`` removes it. Past ``timeout_s``: RuntimeError naming the requests."""
        self._on_node_0("pause_generation", lambda: self._pause_here(timeout_s))

    def _pause_here(self, timeout_s: float) -> None:
        tm = self.engine.tokenizer_manager
        try:
            self._call(_pause_reaping(tm, self.engine.async_pause_generation(mode="abort")), timeout_s)
        except TimeoutError:
            waiting = sorted(tm.rid_to_state)
            raise RuntimeError(
                f"sglang-jax pause_generation did not return within {timeout_s}s; "
                f"{len(waiting)} request(s) still tracked: {waiting[:4]}"
            ) from None

    def continue_generation(self) -> None:
        self._on_node_0("continue_generation", lambda: self._call(self.engine.async_continue_generation()))

    def _on_node_0(self, what: str, send: Any) -> None:
        """``send`` from node 0 (the one tokenizer manager), then a barrier over every process."""
        if self.procs.count == 1:
            send()
            return
        try:
            if self.procs.index == 0:
                send()
        finally:
            dist.barrier(f"engine/{what}")

    def shutdown(self) -> None:
        """Multi-process: also leaves ``jax.distributed`` (the engine's end is every process's). The
        IPC files sglang-jax made for its sockets (``PortArgs.init_new``: five in the temp directory,
        never removed by it) are removed."""
        try:
            self.engine.shutdown()
        finally:
            remove_ipc_files(getattr(self.engine, "port_args", None))
        if self.procs.count > 1:
            dist.shutdown()


def remove_ipc_files(port_args: Any) -> list[str]:
    """Unlink the ``ipc://`` paths of sglang-jax's ``PortArgs`` that lie directly in the temp
    directory (nothing else); the paths removed."""
    tmp = os.path.realpath(tempfile.gettempdir())
    gone = []
    for value in vars(port_args).values() if port_args is not None else ():
        if isinstance(value, str) and value.startswith("ipc://"):
            path = value.removeprefix("ipc://")
            if os.path.dirname(os.path.realpath(path)) == tmp and os.path.lexists(path):
                os.unlink(path)
                gone.append(path)
    return gone


def _sleep_when_idle(scheduler: Any, timeout_ms: int = IDLE_POLL_MS) -> None:
    """Make an idle scheduler wait up to ``timeout_ms`` for its next message instead of spinning
    (its loop polls ZMQ without blocking, burning a core and the trainer's GIL)."""
    import zmq

    poller = zmq.Poller()
    for sock in (scheduler.recv_from_tokenizer, scheduler.recv_from_rpc):
        if sock is not None:
            poller.register(sock, zmq.POLLIN)
    if not poller.sockets:
        return
    original = scheduler.on_idle

    def on_idle() -> None:
        original()
        if scheduler.is_fully_idle():  # nothing queued, running, chunked or pending anywhere
            poller.poll(timeout_ms)

    scheduler.on_idle = on_idle


async def _pause_reaping(tm: Any, pause: Any) -> Any:
    """Await ``pause`` while removing finished entries of ``tm.rid_to_state`` (on the engine's loop)."""
    task = asyncio.ensure_future(pause)
    try:
        while not task.done():
            for rid, state in list(tm.rid_to_state.items()):
                if state.finished:
                    tm.rid_to_state.pop(rid, None)
            await asyncio.wait({task}, timeout=0.02)
    finally:
        task.cancel()  # a no-op once done; stops the pause when we are cancelled (timeout)
    return task.result()


@contextlib.contextmanager
def _launched_scheduler():
    """Capture the in-process scheduler launcher's ``{"scheduler": ...}``: on nodes >= 1 ``Engine()``
    drops it, and blocks unless ``SGLANG_BLOCK_NONZERO_RANK_CHILDREN=0``."""
    from sgl_jax.srt.entrypoints import engine as engine_mod

    launched: dict[str, Any] = {}
    original = engine_mod.run_scheduler_loop_thread_after_create

    def capture(*args: Any, **kwargs: Any) -> Any:
        info = original(*args, **kwargs)
        launched.update(info or {})
        return info

    block = os.environ.get("SGLANG_BLOCK_NONZERO_RANK_CHILDREN")
    engine_mod.run_scheduler_loop_thread_after_create = capture
    os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = "0"
    try:
        yield launched
    finally:
        engine_mod.run_scheduler_loop_thread_after_create = original
        if block is None:
            os.environ.pop("SGLANG_BLOCK_NONZERO_RANK_CHILDREN", None)
        else:
            os.environ["SGLANG_BLOCK_NONZERO_RANK_CHILDREN"] = block

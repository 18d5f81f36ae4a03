"""Torch memory planner: ``measure(req) -> Measured`` (``mllm_rl/memplan/request.py``), per device
(a node target such as ``h100x8`` plans one card, the trainer sharded by FSDP2 on a fake process group).

- ``trainer_params``, ``grads``, ``optimizer``, ``grad_step`` (``fake_tensor``): the real
  ``TorchTrainer`` stepped in ``FakeTensorMode`` under ``MemTracker`` on the fake CPU (fake CUDA
  tensors cannot run backward without a CUDA context): same bytes, no 512-byte rounding.
- ``engine_weights``, ``kv_pool``, ``staging`` (``layout``): the engine's own rules, cited below.

- ``blas_workspaces`` (``layout``, CUDA): torch's cuBLAS workspaces, by torch's own sizing rule.

Not predicted: other CUDA workspaces, contexts, fragmentation, SGLang's activations and CUDA graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import math
import os
import re
import resource
import time
import warnings
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from mllm_rl import faults
from mllm_rl.backends.torch import sglang_calls as sc
from mllm_rl.backends.torch.options import TorchModelOptions
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.checkpoint.safetensors_io import TensorInfo
from mllm_rl.memplan.compose import GIB, Component, FunctionMemory, Target
from mllm_rl.memplan.kv import kv_cell_bytes, mem_fraction_for, pool_requests
from mllm_rl.memplan.request import Measured, PlanRequest
from mllm_rl.presets import ModelConfig
from mllm_rl.progress import progress_bar
from mllm_rl.trainer import RolloutBatch, TrainConfig

MIB = 2**20
MAX_CARDS = 8  # a node's cards (hNNNxK)
NODE_CARDS = (2, 4, 8)  # the node targets listed
# name -> (device kind, XLA GPU target config giving the card's memory, as the JAX planner uses)
GPUS: dict[str, tuple[str, str]] = {
    "h100": ("NVIDIA H100 80GB HBM3 (SXM)", "h100_sxm.txtpb"),
    "h200": ("NVIDIA H200 (SXM)", "h200.txtpb"),
}
_TARGET = re.compile(r"^(h100|h200)(?:x(\d+))?$")
_LOCAL = re.compile(r"^(cpu|cuda)(?:x(\d+))?$")  # this machine, one process per device (xN: N of them)
DTYPES = {"bfloat16": (2, "BF16"), "float16": (2, "F16"), "float32": (4, "F32")}  # itemsize, safetensors
KL_BETA = 0.04  # any beta > 0 takes the KL code path; its value does not change memory
# one step: TorchTrainer makes its AdamW state when built, so a second step runs on the same
# tensors (test_a_second_step_plans_the_same_bytes_as_the_first keeps it so)
STEPS = 1
PAGE_SIZE = 1  # SGLang's default page size for the CUDA attention backends of a dense model
ROPE_CACHE_BYTES = 4  # SGLang keeps the RoPE cos/sin cache in float32 on CUDA
# torch keeps a cuBLAS workspace per (handle, stream), handles per thread: a run's matmuls use two,
# the main thread's (generate, forward) and autograd's backward thread's (measured on an H200: two
# 32 MiB blocks stay allocated after release_rollout)
BLAS_WORKSPACES = 2


LOCAL_TARGETS = {
    "cpu": "this machine's CPU: the host's RAM (psutil); what a run on CPU plans itself against",
    "cuda": "this process's CUDA device: its memory (torch.cuda.mem_get_info); what a run on CUDA plans itself against",
}
# Also taken (not listed): ``cpuxN`` / ``cudaxN``, a run of N processes here (``target_for_runtime``).


def targets() -> dict[str, str]:
    """What ``--target`` accepts with ``--backend torch``: one card, a node of N, or this machine's device."""
    out = {}
    for name, (kind, config) in GPUS.items():
        memory = card_memory(config) / GIB
        out[name] = out[f"{name}x1"] = f"1 x {kind}, {memory:.2f} GiB (XLA GPU target config {config})"
        for k in NODE_CARDS:
            out[f"{name}x{k}"] = f"{k} x {kind} on one node (one process per card; FSDP2 unless fsdp 1)"
    return {**out, **LOCAL_TARGETS}


def target_for_runtime(runtime: dict[str, Any]) -> str | None:
    """The target a run plans itself against: ``cpu`` / ``cuda``, ``cpuxN`` / ``cudaxN`` for N processes."""
    kind = {"cpu": "cpu", "cuda": "cuda"}.get(str(runtime.get("platform")))
    n = int(runtime.get("process_count", 1))
    if kind is None or not 1 <= n <= MAX_CARDS:
        return None
    return kind if n == 1 else f"{kind}x{n}"


def plans_in_process(target: str) -> bool:
    """Not once this process joined a real process group (the fake one that traces FSDP2 cannot open)."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized())


def card_memory(config: str) -> int:
    """``device_memory_size`` of an XLA GPU target config in ``mllm_rl/assets/gpu_targets``."""
    text = resources.files("mllm_rl").joinpath("assets", "gpu_targets", config).read_text()
    m = re.search(r"device_memory_size:\s*(\d+)", text)
    if m is None:
        raise RuntimeError(f"{config}: no device_memory_size")
    return int(m.group(1))


def parse_target(name: str) -> Target:
    """``h100`` / ``h200`` (``xN``: a node of N cards), or ``LOCAL_TARGETS`` (``xN``: N processes here,
    one device each; on CPU each plans 1/N of the host's budget)."""
    local = _LOCAL.match(name)
    if local is not None:
        return _local_target(name, local.group(1), int(local.group(2) or 1))
    m = _TARGET.match(name)
    if m is None:
        raise ValueError(f"PlanRequest.target {name!r}: the torch planner knows {', '.join(targets())}")
    cards = int(m.group(2) or 1)
    if not 1 <= cards <= MAX_CARDS:
        raise ValueError(f"PlanRequest.target {name!r}: 1 to {MAX_CARDS} cards on one node")
    kind, config = GPUS[m.group(1)]
    source = f"XLA GPU target config {config} (device_memory_size; openxla/xla's spec of the card)"
    return Target(name, "gpu", cards, 1, card_memory(config), kind, source)


def _local_target(name: str, kind: str, n: int) -> Target:
    """This machine's ``cpu`` or ``cuda`` device, ``n`` processes of one device each."""
    if not 1 <= n <= MAX_CARDS:
        raise ValueError(f"PlanRequest.target {name!r}: 1 to {MAX_CARDS} processes on this machine")
    if kind == "cpu":
        from mllm_rl.memplan.cpu_budget import cpu_device_bytes

        budget, source, total = cpu_device_bytes()
        if n > 1:
            source = f"{source}; shared by {n} processes, each planned for 1/{n}"
        return Target(name, "cpu", n, 1, budget // n, "CPU", source, total)
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"PlanRequest.target {name!r}: torch sees no CUDA device here (plan h100 or h200)")
    import psutil

    many = f"; {n} processes, one such card each" if n > 1 else ""
    total, kind = torch.cuda.mem_get_info()[1], torch.cuda.get_device_name()
    source = f"torch.cuda.mem_get_info (this device{many})"
    return Target(name, "gpu", n, 1, total, kind, source, psutil.virtual_memory().total)


def check_request(req: PlanRequest) -> Target:
    """Validate everything before any work; ValueError naming the field."""
    if req.backend != "torch":
        raise ValueError(f"PlanRequest.backend {req.backend!r}: this is the torch planner")
    if req.tp != 1:
        raise ValueError(
            f"PlanRequest.tp {req.tp}: the torch trainer runs on one device (no tensor "
            "parallelism); plan with tp=1"
        )
    if req.param_dtype not in DTYPES:
        raise ValueError(f"PlanRequest.param_dtype {req.param_dtype!r}: expected one of {', '.join(DTYPES)}")
    if req.trainer_tp != 1:
        raise ValueError(
            f"PlanRequest.trainer_tp {req.trainer_tp}: the torch trainer has no tensor parallelism"
        )
    try:
        TorchModelOptions.from_pairs(req.options)
    except ValueError as e:
        raise ValueError(f"PlanRequest.options: {e}") from None
    if req.schedule not in ("multi_stage", "naive"):
        raise ValueError(f"PlanRequest.schedule {req.schedule!r}: expected multi_stage or naive")
    if req.mem_fraction_static is not None and not 0 < req.mem_fraction_static < 1:
        raise ValueError(f"PlanRequest.mem_fraction_static {req.mem_fraction_static}: expected 0 < x < 1")
    target = parse_target(req.target)
    from mllm_rl.backends.torch import fsdp

    fsdp.resolve(req.fsdp, target.num_devices)  # ValueError naming --fsdp
    engine = engine_of(req, target)
    if engine == "sglang" and target.num_devices > 1:
        raise ValueError(
            f"PlanRequest.engine 'sglang' on {target.name}: SGLang across processes is not supported yet; "
            "a run of one process per card starts the embedded engine on each (engine embedded)"
        )
    if engine == "sglang" and target.platform == "cpu":
        raise ValueError(
            "PlanRequest.engine 'sglang': SGLang runs on CUDA; a run on cpu uses the embedded engine"
        )
    if engine == "embedded" and req.mem_fraction_static is not None:
        raise ValueError(
            "PlanRequest.mem_fraction_static: the embedded engine has none (its KV pool is kv_tokens)"
        )
    return target


check = check_request  # the planner contract's name (``python -m mllm_rl.memplan``)


def engine_of(req: PlanRequest, target: Target) -> str:
    """``req.engine``, ``auto`` resolved as a run would: SGLang on one GPU, else the embedded engine."""
    if req.engine != "auto":
        return req.engine
    return "embedded" if target.platform == "cpu" or target.num_devices > 1 else "sglang"


# -- the trainer step on fake tensors ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StepMemory:
    """What MemTracker saw of ``TorchTrainer.device_step`` (bytes on the fake device): ``params`` /
    ``grads`` / ``optimizer`` just before an optimizer step and ``peak_total`` without
    ``host_scalars`` (AdamW's host counters, in ``peak``'s ``Optstate``); ``fwd_bwd_peak``: the peak
    before the first optimizer step."""

    params: int
    grads: int
    optimizer: int
    ref_params: int
    peak: dict[str, int]
    peak_total: int
    host_scalars: int
    rows: int
    micro_batch: int
    micro_batches: int
    seq_len: int
    seconds: float
    master_dtype: str
    compute_dtype: str
    options: tuple[tuple[str, Any], ...] = ()
    fwd_bwd_peak: dict[str, int] = dataclasses.field(default_factory=dict)
    adamw: str = "fused"
    world: int = 1  # > 1: FSDP2 over this many devices, the figures one device's
    cached: bool = False  # read from the plan cache (``traced_step``), not traced by this process

    @property
    def shape(self) -> str:
        """``"2 micro-batch(es) of 4 x 4096 tokens"``."""
        first = min(self.rows, self.micro_batch)
        where = f" on each of {self.world} devices" if self.world > 1 else ""
        return f"{self.micro_batches} micro-batch(es) of {first} x {self.seq_len} tokens{where}"

    @property
    def activations(self) -> int:
        """Bytes at the peak beyond params (KL reference included), gradients and optimizer state."""
        return self._beyond_state(self.peak)

    @property
    def fwd_bwd_activations(self) -> int:
        """``activations`` at the forward/backward peak: what activation checkpointing changes."""
        return self._beyond_state(self.fwd_bwd_peak)

    def _beyond_state(self, peak: dict[str, int]) -> int:
        total = peak.get("Total", sum(peak.values())) - self.host_scalars
        held = self.params + self.ref_params + peak.get("Gradient", 0) + self.optimizer
        return total - held


def layout_dir(config: ModelConfig, dtype: str) -> ModelDir:
    """A ``ModelDir`` with the checkpoint's names, shapes and dtype and no files."""
    itemsize, st_dtype = DTYPES[dtype]
    tensors, off = {}, 0
    for name, shape in config.param_shapes().items():
        n = math.prod(shape) * itemsize
        tensors[name] = (Path(), TensorInfo(name, st_dtype, shape, off, off + n))
        off += n
    return ModelDir(Path(f"<layout of {config.name}>"), config, tensors)


def _tracker_class() -> type:
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker

    device_query = torch.ops.prim.device.default

    class PeakTracker(MemTracker):
        """MemTracker tracking only the global peak (the module-wise one is ~20x slower), with no
        gradient hook on frozen or non-leaf parameters (MemTracker raises on those), and device
        queries passed straight on (autograd asks one per tensor it touches: about 2 of every 3
        ops a train step dispatches, none of which allocates)."""

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is device_query:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _update_peak_stats(self, peak_state: Any) -> None:
            saved, self.memory_tracking = self.memory_tracking, {}
            try:
                super()._update_peak_stats(peak_state)
            finally:
                self.memory_tracking = saved

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> Any:
            hooks = self._param_to_grad_hook_handles
            frozen = [p for p in module.parameters() if not p.requires_grad or p.grad_fn is not None]
            frozen = [p for p in frozen if p not in hooks]
            for p in frozen:  # MemTracker skips parameters that already have hook handles
                hooks[p] = ()
            try:
                with warnings.catch_warnings():  # it reads ``.grad`` of the non-leaf casts too (None)
                    warnings.filterwarnings(
                        "ignore", message="The .grad attribute of a Tensor that is not a leaf"
                    )
                    return super()._track_module_params_and_buffers(module, install_grad_hooks)
            finally:
                for p in frozen:
                    hooks.pop(p, None)

    return PeakTracker


def _bytes(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """MemTracker snapshot {device: {category: bytes}} -> {category name: bytes} over devices."""
    out: dict[str, int] = {}
    for per_dev in snapshot.values():
        for k, v in per_dev.items():
            name = str(getattr(k, "value", k))
            out[name] = out.get(name, 0) + int(v)
    return out


def step_batch(config: ModelConfig, rows: int, seq_len: int) -> RolloutBatch:
    """A rollout batch of ``rows x seq_len`` tokens, the second half completion."""
    rng = np.random.default_rng(0)
    loss = np.zeros((rows, seq_len), bool)
    loss[:, seq_len // 2 :] = True
    tokens = rng.integers(0, config.vocab_size, (rows, seq_len)).astype(np.int32)
    zeros = np.zeros((rows, seq_len), np.float32)
    return RolloutBatch(tokens, np.ones((rows, seq_len), bool), loss, zeros, np.ones(rows, np.float32))


def _collected(fn: Any) -> Any:
    """``fn``, then ``gc.collect()`` (the fake trainer leaves the CPU probe's WeakSet once collected)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        finally:
            gc.collect()

    return run


@functools.lru_cache(maxsize=8)  # one plan per schedule of the same request traces the step once
@_collected
def trainer_step_memory(
    config: ModelConfig,
    micro_batch: int,
    seq_len: int,
    rows: int,
    dtype: str = "bfloat16",
    lora_rank: int = 0,
    kl: bool = False,
    steps: int = STEPS,
    precision: str = TrainConfig.precision,
    attention: str = "sdpa",
    logprob_chunk: int | None | str = "model",
    options: tuple[tuple[str, Any], ...] = (),
    device: str = "cuda",
    world: int = 1,
) -> StepMemory:
    """Run ``TorchTrainer.device_step`` ``steps`` times on fake tensors under MemTracker: ``rows`` x
    ``seq_len`` tokens in micro-batches of ``micro_batch``; ``attention`` / ``logprob_chunk``: also
    ``"eager"`` / ``None`` (``bench/torch_attention.py``); ``device``: the planned device type (it
    decides AdamW's implementation); ``world`` > 1: rank 0 of FSDP2 on torch's fake process group."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.modules.module import register_module_forward_pre_hook

    from mllm_rl.backends.torch import cpu_half, fsdp
    from mllm_rl.backends.torch.model import build_qwen3
    from mllm_rl.backends.torch.options import TorchModelOptions
    from mllm_rl.backends.torch.trainer import TorchTrainer
    from mllm_rl.rl.loss_config import LossConfig

    t0 = time.perf_counter()
    lora = lora_rank > 0
    # the implementation ``adamw`` means on the planned device, not on the fake CPU one
    adamw = TorchModelOptions.from_pairs(options).adamw_on(device)
    on_device = {**dict(options), "adamw": adamw}
    cfg = TrainConfig(
        micro_batch_size=micro_batch,
        lora_rank=lora_rank,
        precision=precision,
        loss=LossConfig(beta=KL_BETA if kl else 0),
        model_options=tuple(on_device.items()),
    )
    meta = build_qwen3(config, getattr(torch, dtype), "meta", attention)
    if logprob_chunk != "model":
        meta.logprob_chunk = logprob_chunk
    with fake_process_group(world) as shard_over:  # None for one device
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            model = meta.to_empty(device="cpu")
            # full fine-tune + KL: built without it (on CPU its reference would be numpy buffers),
            # then given the CUDA path's host tensors of the initial params
            init_cfg = dataclasses.replace(cfg, loss=LossConfig(beta=0.0)) if kl and not lora else cfg
            trainer = TorchTrainer(
                layout_dir(config, dtype), init_cfg, device="cpu", model=model, shard_over=shard_over
            )
            if kl and not lora:
                trainer.cfg = cfg
                trainer.ref_host = {  # sharded: this device's shards
                    n: torch.empty_like(fsdp.local(p), device="meta", dtype=trainer.compute_dtype)
                    for n, p in trainer.trainable.items()
                }
        ref_params = sum(h.numel() * h.element_size() for h in (trainer.ref_host or {}).values())
        # on CUDA the step counters of a non-fused AdamW are host tensors
        unfused = [g for g in trainer.optimizer.param_groups if device == "cuda" and not g["fused"]]
        counters = (trainer.optimizer.state.get(p, {}).get("step") for g in unfused for p in g["params"])
        host_scalars = sum(t.numel() * t.element_size() for t in counters if isinstance(t, torch.Tensor))
        batch = step_batch(config, rows, seq_len)
        tracker = _tracker_class()()
        tracker.track_external(trainer.model, trainer.optimizer)
        before_step: list[dict[str, int]] = []
        peak_before_step: list[dict[str, int]] = []

        def at_step(*_: Any) -> None:
            before_step.append(_bytes(tracker.get_tracker_snapshot("current")))
            peak_before_step.append(_bytes(tracker.get_tracker_snapshot("peak")))

        hooks = [
            trainer.optimizer.register_step_pre_hook(at_step),
            # MemTracker refuses a second call of the root module: forget the module-wise stats
            register_module_forward_pre_hook(
                lambda m, _: tracker.reset_mod_stats() if m is trainer.model else None
            ),
        ]
        try:
            with (
                fake,
                tracker,
                faults.suspended(),
                # a planned GPU's 16-bit GEMMs: one op each, no float32 copies (cpu_half.py)
                cpu_half.dispatched_as_on_gpu() if device != "cpu" else contextlib.nullcontext(),
                progress_bar(steps, "fake-tensor train step", unit="step") as bar,
            ):
                # hooks on the masters now: a mixed-precision forward swaps their casts into the modules
                tracker._track_module_params_and_buffers(trainer.model)
                for _ in range(steps):
                    trainer.device_step(batch)
                    bar.update()
        finally:
            for h in hooks:
                h.remove()
        peak = _bytes(tracker.get_tracker_snapshot("peak"))
        pre = before_step[-1]
        return StepMemory(
            # MemTracker counts the swapped-in KL reference as params (not when sharded)
            params=pre.get("Parameter", 0) - (0 if trainer.sharded else ref_params),
            grads=pre.get("Gradient", 0),
            optimizer=pre.get("Optstate", 0) - host_scalars,
            ref_params=ref_params,
            peak=peak,
            peak_total=peak.get("Total", sum(peak.values())) - host_scalars,
            host_scalars=host_scalars,
            rows=rows,
            micro_batch=micro_batch,
            micro_batches=-(-math.ceil(rows / micro_batch) // world),  # this device's share
            world=world,
            seq_len=seq_len,
            seconds=time.perf_counter() - t0,
            master_dtype=str(trainer.master_dtype).removeprefix("torch."),
            compute_dtype=str(trainer.compute_dtype).removeprefix("torch."),
            options=tuple(options),
            fwd_bwd_peak=peak_before_step[0],
            adamw=adamw,
        )


@contextlib.contextmanager
def fake_process_group(world: int) -> Iterator[tuple[Any, Any] | None]:
    """``world`` > 1: torch's fake process group and a CPU mesh over it (the ``shard_over``)."""
    if world == 1:
        yield None
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mllm_rl.backends.torch import fsdp
    from mllm_rl.backends.torch.distributed import Procs

    if dist.is_initialized():
        raise ValueError(
            f"a plan of {world} devices runs torch's fake process group; this process has joined a real one "
            "(plan it with python -m mllm_rl.memplan)"
        )
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        import torch

        yield fsdp.make_mesh(world, torch.device("cpu")), Procs(0, world)
    finally:
        dist.destroy_process_group()


def options_key(options: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A request's model options as normalised (key, value) pairs, defaults left out."""
    opts = TorchModelOptions.from_pairs(options)
    default = TorchModelOptions()
    return tuple(
        (f.name, getattr(opts, f.name))
        for f in dataclasses.fields(opts)
        if getattr(opts, f.name) != getattr(default, f.name)
    )


# -- SGLang's layout -------------------------------------------------------------------------------
def sglang_weight_bytes(config: ModelConfig, itemsize: int) -> tuple[int, str]:
    """Bytes of SGLang's Qwen3 weights (tp=1) and how they add up: the checkpoint's tensors, the
    vocabulary padded to a multiple of 64 (``vocab_parallel_embedding.py``), ``lm_head`` tied when
    the config says so, a float32 RoPE cache ``[max_position_embeddings, head_dim]``."""
    pad = -(-config.vocab_size // 64) * 64 - config.vocab_size
    tables = 1 if config.tie_word_embeddings else 2
    weights = (config.num_params() + pad * config.hidden_size * tables) * itemsize
    rope = config.max_position_embeddings * config.head_dim * ROPE_CACHE_BYTES
    detail = (
        f"{config.num_params():,} params x {itemsize} B, vocab padding {pad} rows, RoPE cache "
        f"{rope / MIB:.1f} MiB fp32"
    )
    return weights + rope, detail


def sglang_pool_tokens(free_at_start: int, weight_bytes: int, cell: int, mem_fraction_static: float) -> int:
    """SGLang's KV pool in tokens with no cap: (free x mfs - weights) // cell (``kv_cache_configurator.py``)."""
    rest = int(free_at_start * mem_fraction_static) - weight_bytes
    return max(0, rest // cell // PAGE_SIZE * PAGE_SIZE)


def sglang_pool_bytes(tokens: int, cell: int, context_len: int, max_running_requests: int) -> int:
    """Bytes SGLang allocates in ``kv_cache``: K and V of ``tokens + page_size`` slots
    (``memory_pool.py``) and the int32 ``req_to_token`` table ``(reqs + 1) x (context_len + 4)``."""
    reqs = min(max_running_requests, max(tokens // 2, 1))
    return (tokens + PAGE_SIZE) * cell + (reqs + 1) * (context_len + 4) * 4


def staging_bytes(
    config: ModelConfig, itemsize: int, chunk: int = sc.CHUNK_BYTES, lora: bool = False, cast: bool = False
) -> int:
    """The largest bucket ``SglangEngine.update_weights`` stages at once, plus the one tensor
    ``export_weights`` makes meanwhile (a LoRA-merged weight, or the cast of a float32 master)."""
    items = [(n, math.prod(s) * itemsize, math.prod(s) * itemsize) for n, s in config.param_shapes().items()]
    biggest = max(sum(nbytes for _, nbytes in bucket) for bucket, _ in sc.update_buckets(items, chunk))
    in_flight = max(nbytes for _, _, nbytes in items) if lora or cast else 0
    return biggest + in_flight


# -- the planner ---------------------------------------------------------------------------------
def _trainer_figures(req: PlanRequest, step: StepMemory) -> tuple[dict[str, Component], FunctionMemory]:
    """The trainer's components and its ``grad_step`` function from the traced step."""
    dt, mt = step.compute_dtype, step.master_dtype
    mixed = mt != dt
    if req.lora_rank:
        what = f"LoRA base ({dt}) + adapters ({mt}{' masters' if mixed else ''})"
    else:
        what = f"{mt} masters (computing in {dt})" if mixed else dt
    if step.adamw == "fused":
        opt = f"AdamW (fused) exp_avg + exp_avg_sq ({mt}) and float32 step counters on the device"
    else:
        opt = f"AdamW exp_avg + exp_avg_sq ({mt}); {step.host_scalars} B of step counters on host"
    comps = {
        "trainer_params": Component(
            "trainer_params", step.params, "fake_tensor", f"TorchTrainer params: {what}"
        ),
        "grads": Component("grads", step.grads, "fake_tensor", f"gradients of the trainable params ({mt})"),
        "optimizer": Component("optimizer", step.optimizer, "fake_tensor", opt),
    }
    if step.ref_params:
        why = f"KL reference: the initial trainable params ({dt}), copied to the device each step"
        comps["ref_params"] = Component("ref_params", step.ref_params, "layout", why)
    cats = ", ".join(f"{k} {v / MIB:.1f}" for k, v in step.peak.items() if k != "Total" and v)
    fwd_bwd = step.fwd_bwd_peak.get("Total", 0) - step.host_scalars
    opts = "; model options " + ", ".join(f"{k}={v}" for k, v in step.options) if step.options else ""
    fn = FunctionMemory(
        "grad_step",
        peak_bytes=step.peak_total,
        argument_bytes=step.params + step.optimizer + step.grads + step.ref_params,
        temp_bytes=step.activations,
        method="fake_tensor",
        detail=f"TorchTrainer.device_step x{STEPS}, {step.shape} (forward, backward, clipping, AdamW {step.adamw}; "
        f"KL reference forward when on{'; casts of the masters to ' + dt if mixed else ''}{opts}); "
        f"MiB at the peak: {cats}; forward/backward peak {fwd_bwd / MIB:.1f} MiB, activations and "
        f"temporaries there {step.fwd_bwd_activations / MIB:.1f} MiB",
    )
    return comps, fn


@dataclasses.dataclass(frozen=True)
class Pool:
    """SGLang's KV pool for a request: ``tokens`` (+ ``PAGE_SIZE``) x ``cell`` bytes + req_to_token."""

    tokens: int
    cell: int
    bytes: int
    mem_fraction_static: float  # the value that makes SGLang build it from ``free`` bytes
    free: int  # bytes free on the device when the engine starts (the engine starts first: the card)
    notes: tuple[str, ...]


def sglang_pool(req: PlanRequest, weight_bytes: int, free: int, itemsize: int) -> Pool:
    """The pool SGLang builds: ``req.kv_tokens`` None: its rule at ``req.mem_fraction_static``;
    given: that many tokens, capped by the rule when ``mem_fraction_static`` is also given, else
    the ``mem_fraction_static`` it needs. ``ValueError`` when SGLang would refuse to start."""
    c = req.model
    cell = kv_cell_bytes(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, itemsize)
    notes = []
    if req.kv_tokens is None:
        mfs = req.mem_fraction_static if req.mem_fraction_static is not None else sc.MEM_FRACTION_STATIC
        tokens = sglang_pool_tokens(free, weight_bytes, cell, mfs)
    else:
        tokens = req.kv_tokens
        mfs = mem_fraction_for(weight_bytes, tokens * cell, free)
        if req.mem_fraction_static is not None:
            cap = sglang_pool_tokens(free, weight_bytes, cell, req.mem_fraction_static)
            if cap < tokens:
                notes.append(
                    f"kv_tokens {tokens} asked; SGLang's rule at mem_fraction_static "
                    f"{req.mem_fraction_static} caps the pool at {cap} tokens (it warns, and uses {cap})"
                )
                tokens = cap
            mfs = req.mem_fraction_static
        else:
            notes.append(
                f"SGLang builds this pool with mem_fraction_static >= {mfs} ({free} B free at engine "
                f"start; the adapter's default is {sc.MEM_FRACTION_STATIC})"
            )
    if tokens < 1:
        raise ValueError(
            f"{c.name} on {req.target}: SGLang leaves no room for a KV pool next to "
            f"{weight_bytes / GIB:.2f} GiB of weights at mem_fraction_static {mfs} (it refuses to start: "
            "'Loaded weights leave no GPU memory for the KV cache')"
        )
    demand = req.prompts * req.group_size * req.seq_len
    if tokens < demand:
        notes.append(
            f"the rollout batch holds up to {demand} tokens at once ({req.prompts} x "
            f"{req.group_size} x {req.seq_len}); a pool of {tokens} runs it in waves"
        )
    size = sglang_pool_bytes(tokens, cell, req.seq_len, req.max_running_requests)
    return Pool(tokens, cell, size, mfs, free, tuple(notes))


@dataclasses.dataclass(frozen=True)
class EngineFigures:
    """The rollout engine's side of a plan: its two components, notes and ``Measured.info`` facts."""

    weights: Component
    kv_pool: Component
    notes: list[str]
    info: dict[str, Any]


def embedded_engine(req: PlanRequest, target: Target, itemsize: int) -> EngineFigures:
    """``EmbeddedEngine``'s weights and KV cache, [layers, 2, tokens, kv_heads, head_dim] of
    ``req.kv_tokens`` tokens (None: the run's rule, ``memplan.kv.pool_requests``)."""
    c = req.model
    n = sum(math.prod(s) for s in c.param_shapes().values())  # the checkpoint's tensors, nothing padded
    cell = kv_cell_bytes(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, itemsize)
    notes = []
    tokens = req.kv_tokens
    if tokens is None:
        tokens = pool_requests(req.prompts, req.group_size, req.max_running_requests) * req.seq_len
        notes.append(
            f"KV pool: min(max_running_requests, prompts x group_size) x seq_len = {tokens} tokens (the "
            "run's rule where its --eval-prompts are fewer; --kv-tokens sets it)"
        )
    rest = "CUDA kernel workspaces other than cuBLAS's, CUDA contexts, allocator fragmentation"
    if target.platform == "cpu":
        rest = "the Python and library memory of the process"
    notes.append(f"not in any figure: the embedded engine's decode activations (engine_step), {rest}")
    return EngineFigures(
        Component("engine_weights", n * itemsize, "layout", f"embedded engine: {n:,} params x {itemsize} B"),
        Component("kv_pool", tokens * cell, "layout", f"embedded engine: {tokens} tokens x {cell} B/token"),
        notes,
        {"kv_tokens": tokens, "kv_cell_bytes": cell, "kv_pad_tokens": 0, "engine": "embedded"},
    )


def sglang_engine(req: PlanRequest, target: Target, itemsize: int) -> EngineFigures:
    """SGLang's weights and KV pool by its own rules (``ValueError`` when it would not start)."""
    weights, detail = sglang_weight_bytes(req.model, itemsize)
    pool = sglang_pool(req, weights, target.hbm_bytes, itemsize)
    kv = f"SGLang MHA pool: ({pool.tokens} + {PAGE_SIZE}) tokens x {pool.cell} B/token + req_to_token"
    notes = [
        *pool.notes,
        "not in any figure: CUDA kernel workspaces other than cuBLAS's (attention), CUDA contexts, allocator "
        "fragmentation, SGLang's decode activations and CUDA graphs (engine_step; SGLang keeps "
        "1 - mem_fraction_static for them)",
        "torch_memory_saver regions: weights = engine_weights, kv_cache = kv_pool, cuda_graph: its size is "
        "known only after capture on the GPU",
    ]
    info = dict(kv_tokens=pool.tokens, kv_cell_bytes=pool.cell, kv_pad_tokens=PAGE_SIZE, engine="sglang")
    info.update(mem_fraction_static=pool.mem_fraction_static, engine_free_bytes=pool.free)
    weights_c = Component("engine_weights", weights, "layout", f"SGLang Qwen3: {detail}")
    return EngineFigures(weights_c, Component("kv_pool", pool.bytes, "layout", kv), notes, info)


def blas_workspace_bytes(cc_major: int, config: str | None) -> int:
    """One cuBLAS workspace as torch sizes it (``getChosenWorkspaceSize`` in pytorch's
    aten/src/ATen/cuda/CublasHandlePool.cpp): ``CUBLAS_WORKSPACE_CONFIG``'s ``:KiB:count`` pairs
    summed; unset, 32 MiB on compute capability 9-12 (Hopper, Blackwell), else 8 MiB + 128 KiB."""
    if config:
        pairs = re.findall(r":(\d+):(\d+)", config)
        if pairs:
            return sum(int(k) * int(n) for k, n in pairs) * 1024
    return 4096 * 8 * 1024 if 9 <= cc_major <= 12 else 4096 * 1024 * 2 + 16 * 1024 * 8


def blas_workspaces(target: Target) -> Component:
    """``BLAS_WORKSPACES`` cuBLAS workspaces on a CUDA target (this card's compute capability, or
    9 for the H100/H200 targets); ``CUBLAS_WORKSPACE_CONFIG`` as this process has it."""
    major = 9
    if target.name.startswith("cuda"):
        import torch

        major = torch.cuda.get_device_capability()[0]
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    one = blas_workspace_bytes(major, config)
    why = f"CUBLAS_WORKSPACE_CONFIG={config}" if config else f"torch's default for compute capability {major}"
    return Component(
        "blas_workspaces", BLAS_WORKSPACES * one, "layout",
        f"{BLAS_WORKSPACES} cuBLAS workspaces (the main and the backward thread's) of {one / MIB:g} MiB: {why}",
    )  # fmt: skip


def traced_step(*shape: Any, **kw: Any) -> StepMemory:
    """``trainer_step_memory(*shape, **kw)``, from the plan cache (``mllm_rl.memplan.cache``) when
    this code and torch traced it before."""
    from mllm_rl.memplan import cache as plan_cache

    name = plan_cache.key(
        {"what": "torch_step", "shape": [dataclasses.asdict(shape[0]), *shape[1:]], **kw}, ("torch",)
    )
    doc = plan_cache.load(name)
    if doc is not None:
        try:
            doc["options"] = tuple(tuple(o) for o in doc["options"])
            return dataclasses.replace(StepMemory(**doc), cached=True)
        except (KeyError, TypeError):
            pass  # an entry of another shape: traced again, and replaced
    step = trainer_step_memory(*shape, **kw)
    plan_cache.store(name, dataclasses.asdict(step))
    return step


def measure(req: PlanRequest) -> Measured:
    """Predicted per-device components and functions of ``req``; ValueError for a refused request."""
    target = check_request(req)
    c = req.model
    itemsize = DTYPES[req.param_dtype][0]
    figures = embedded_engine if engine_of(req, target) == "embedded" else sglang_engine
    engine = figures(req, target, itemsize)  # refuses before any tracing
    from mllm_rl.backends.torch import fsdp

    world = target.num_devices if fsdp.resolve(req.fsdp, target.num_devices) else 1
    rows = min(req.prompts * req.group_size, 2 * req.micro_batch * world)  # up to 2 micro-batches a device
    shape = (c, req.micro_batch, req.seq_len, rows, req.param_dtype, req.lora_rank, req.kl)
    device = "cpu" if target.platform == "cpu" else "cuda"
    opts = options_key(req.options)
    step = traced_step(*shape, precision=req.precision, options=opts, device=device, world=world)
    comps, grad_step = _trainer_figures(req, step)
    comps["engine_weights"], comps["kv_pool"] = engine.weights, engine.kv_pool
    stage = staging_bytes(c, itemsize, lora=req.lora_rank > 0, cast=step.master_dtype != req.param_dtype)
    bucket = f"largest update bucket (>= {sc.CHUNK_BYTES // MIB} MiB each)"
    comps["staging"] = Component("staging", stage, "layout", bucket)
    if target.platform != "cpu":
        comps["blas_workspaces"] = blas_workspaces(target)
    notes = [
        f"trainer step: {step.shape}, rows = min(prompts x group_size, 2 x micro_batch"
        f"{' x devices' if world > 1 else ''}) = {rows}; {step.seconds:.0f} s of fake-tensor tracing"
        f"{' by an earlier process running the same code (MLLM_RL_PLAN_CACHE)' if step.cached else ''}"
    ]
    if world > 1:
        notes.append(
            f"FSDP2 over {world} devices (one process each): params, gradients and AdamW state are one "
            "device's shards; each device runs its round-robin share of the micro-batches; traced as rank 0 "
            "of torch's fake process group (every layer's all-gather and reduce-scatter buffers counted; "
            "NCCL's own buffers are not)"
        )
    elif target.num_devices > 1:
        notes.append(f"fsdp 1 on {target.num_devices} devices: every process holds the whole trainer")
    notes += engine.notes
    if req.optimizer_dtype != step.master_dtype:
        notes.append(
            f"optimizer_dtype {req.optimizer_dtype} does not apply: torch.optim.AdamW keeps its state "
            f"in the trainable params' dtype ({step.master_dtype}; TrainConfig.precision "
            f"{req.precision!r})"
        )
    trace = f"grad_step (fake-tensor trace{', cached' if step.cached else ''})"
    info = {
        **engine.info,
        "compile_seconds": {trace: 0.0 if step.cached else round(step.seconds, 2)},
        "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    return Measured(target, comps, {"grad_step": grad_step}, notes, info)

"""The JAX backend's memory planner: ``measure(req) -> Measured`` (``mllm_rl.memplan.request``).

For a target topology (``topologies.py``; nothing runs on a device) it compiles the trainer's real
jitted functions (``step_fns.make_step_fns``) and reads each one's ``memory_analysis()`` per device.
Engine weights and KV pool follow sglang-jax's own layout (``engine_layout``); its forward is
compiled for TPU/GPU targets (``engine_compile``) and estimated on CPU. Peak of a compiled function:
``peak_memory_in_bytes`` on TPU/GPU; on CPU ``arguments + outputs - aliased + temporaries``. What
it compiles is kept in the plan cache (``mllm_rl.memplan.cache``) under a key of what decides it,
the source and the compilers' versions (``_stored``).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import time
from collections.abc import Callable
from typing import Any

from mllm_rl.backends.jax import engine_layout, topologies
from mllm_rl.memplan import cache as plan_cache
from mllm_rl.memplan.compose import Component, FunctionMemory
from mllm_rl.memplan.engine_step import forward_bytes
from mllm_rl.memplan.request import Measured, PlanRequest
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.trainer import TrainConfig

T_BUCKET = 32  # the trainer pads a batch's positions to a multiple of this (trainer.T_BUCKET)
KL_BETA = 0.04  # any beta > 0: a KL term (its value does not change memory)
STAGING_COPIES = 2  # tensors in flight during a weight update beyond both resident copies

_cache: dict[tuple[Any, ...], Any] = {}  # per process: topologies, engine layouts, compiled functions
# what the compiled figures depend on besides this package's source (``plan_cache``): the compilers
PACKAGES = ("jax", "jaxlib", "flax", "optax", "sglang-jax", "libtpu", "jax-cuda12-plugin", "jax-cuda12-pjrt",
            "jax-cuda13-plugin", "jax-cuda13-pjrt")  # fmt: skip


def targets() -> dict[str, str]:
    """Target name -> description (what ``--target`` accepts with ``--backend jax``)."""
    return topologies.describe()


def target_for_runtime(runtime: dict[str, Any]) -> str | None:
    """The target of the devices a run came up on: ``cpu`` for one process on CPU; on TPU or GPU
    the slice or node matching the run's (``topologies.match_runtime``); None otherwise."""
    platform, procs = runtime.get("platform"), runtime.get("process_count", 1)
    if platform == "cpu":
        return "cpu" if procs == 1 else None
    kind, n = runtime.get("device_kind"), runtime.get("global_device_count")
    if platform not in ("tpu", "gpu") or not kind or not n:
        return None
    return topologies.match_runtime(platform, kind, int(n), int(procs))


def plans_in_process(target: str) -> bool:
    """Only ``cpu``: a TPU or GPU target's compiler needs a JAX on the CPU platform (a fresh process)."""
    return target == "cpu"


def check(req: PlanRequest) -> None:
    """What ``measure`` refuses that the request alone decides, without importing jax: the engine,
    the target, the engine's and trainer's meshes, the ``--model-option`` values (ValueError)."""
    if req.engine == "embedded":
        raise ValueError(
            "PlanRequest.engine 'embedded': the JAX backend's engine is sglang-jax (auto or sglang)"
        )
    spec = topologies.spec(req.target)
    if spec.platform == "cpu":
        devices, hosts = req.tp, 1  # a run on CPU has --tp devices (``topologies.prepare``)
    else:
        _, devices, hosts = topologies.shape(spec)
    _check_mesh(req, devices, hosts, spec.name)
    model_options(req, spec.platform)


def measure(req: PlanRequest) -> Measured:
    """Components and compiled functions of one colocated RL step for ``req`` (per device);
    ValueError for a request the run would refuse. Only a CPU plan's programs enter JAX's
    persistent compilation cache (``topologies.cache_writes``)."""
    check(req)
    spec = topologies.spec(req.target)
    with topologies.cache_writes(spec.platform == "cpu"):
        return _measure(req, spec)


def _measure(req: PlanRequest, spec: topologies.TargetSpec) -> Measured:
    topologies.prepare(spec, cpu_devices=req.tp)  # a run on CPU has --tp devices (``init_runtime``)
    devices, target = _cached(("topology", spec.name), lambda: topologies.devices(spec))
    _check_mesh(req, target.num_devices, target.num_hosts, target.name)
    opts = model_options(req, target.platform)
    notes: list[str] = []
    info: dict[str, Any] = {"model_options": dataclasses.asdict(opts), "compile_seconds": {}}

    # what the stored figures depend on besides the source and compilers (``_stored``); a CPU
    # plan's budget follows the free RAM and XLA:CPU refuses nothing for its size
    where = {"target": target.name, "devices": target.num_devices, "kind": target.device_kind,
             "hbm": None if target.platform == "cpu" else target.hbm_bytes,
             "model": dataclasses.asdict(req.model), "tp": req.tp}  # fmt: skip

    def engine_weights() -> engine_layout.EngineWeights:
        made = lambda: dataclasses.asdict(engine_layout.weights(req.model, devices, req.tp))  # noqa: E731
        return _stored("engine_weights", where, made, lambda d: engine_layout.EngineWeights(**d))[0]

    eng = _cached(("engine", req.target, req.model, req.tp), engine_weights)
    kv = engine_layout.size_pool(
        req.model,
        req.tp,
        target.hbm_bytes,
        eng.bytes_per_device,
        target.platform,
        req.kv_tokens,
        req.mem_fraction_static,
    )

    def kv_layer() -> int | str:
        made = lambda: {"layer": _compile_layer(req, devices, kv.tokens)}  # noqa: E731
        return _stored("kv_layer", {**where, "tokens": kv.tokens}, made, _layer)[0]

    layer = _cached(("kvlayer", req.target, req.model, req.tp, kv.tokens), kv_layer)
    formula_layer = kv.bytes_per_device // req.model.num_hidden_layers
    default_frac = engine_layout.DEFAULT_MEM_FRACTION[target.platform]
    info.update(kv_tokens=kv.tokens, kv_cell_bytes=kv.cell_bytes, kv_pad_tokens=kv.pad_tokens)
    info.update(mem_fraction_static=kv.mem_fraction_static, engine_free_bytes=kv.free_bytes)
    batch = req.prompts * req.group_size
    logits, rows = engine_layout.logits_bytes(req.model, req.max_running_requests, batch)
    weights = (
        f"sglang-jax Qwen3ForCausalLM sharded over tensor={req.tp}; "
        f"{eng.tensors} arrays; compiler size {eng.compiler_bytes} B"
    )
    one = f"{layer} B (formula {formula_layer} B)" if isinstance(layer, int) else f"REJECTED ({layer})"
    pool = (
        f"sglang-jax MHATokenToKVPool: ({kv.tokens} + {kv.pad_tokens}) tokens x "
        f"{kv.cell_bytes} B/token ({kv.rule}); one layer compiled: {one}"
    )
    kept = (
        f"[{rows}, {req.model.vocab_size}] float32 rows of logits sglang-jax keeps between "
        f"generate calls (max_running_requests {req.max_running_requests}, rollout batch {batch})"
    )
    comps = {
        "engine_weights": Component("engine_weights", eng.bytes_per_device, "layout", weights),
        "kv_pool": Component("kv_pool", kv.bytes_per_device, "layout", pool),
        "engine_logits": Component("engine_logits", logits, "layout", kept),
    }
    if isinstance(layer, int) and layer != formula_layer:
        notes.append(
            f"KV pool: the compiler lays one layer out in {layer} B, the formula says {formula_layer} B"
        )
    if req.kv_tokens is not None and req.mem_fraction_static is None:
        notes.append(
            f"sglang-jax sizes this pool with mem_fraction_static >= {kv.mem_fraction_static} "
            f"(free at engine start: {kv.free_bytes} B per device; the adapter's default is {default_frac})"
        )

    trained = {**where, "micro_batch": req.micro_batch, "seq_len": req.seq_len, "lora_rank": req.lora_rank,
               "kl": req.kl, "precision": req.precision, "options": dataclasses.asdict(opts)}  # fmt: skip
    fns, trainer_comps = _compiled_stored(
        "trainer functions", trained, lambda i, n: _trainer(req, devices, target, opts, i, n), info, notes
    )
    comps.update(trainer_comps)
    # bytes in flight beyond both resident copies: the largest engine tensor's shard, exported and placed
    comps["staging"] = Component(
        "staging",
        STAGING_COPIES * eng.largest_tensor_bytes,
        "layout",
        f"{STAGING_COPIES} x the largest engine tensor shard ({eng.largest_tensor_bytes} B): the "
        "trainer's exported copy and the engine's placed copy of one tensor (estimate)",
    )
    attn = engine_layout.attention_backend(target.platform, target.device_kind)
    info["engine_attention_backend"] = attn
    step = lambda i, n: {"engine_step": _engine_step(req, devices, target, kv.tokens, attn, i, n)}  # noqa: E731
    if target.platform == "cpu" or req.engine_forward == "estimate":  # estimated from the shapes
        fns.update(step(info, notes))
    else:  # compiled for the target
        forward = {**where, "attention": attn, "seq_len": req.seq_len, "pool": kv.tokens,
                   "rows": min(req.max_running_requests, req.prompts * req.group_size),
                   "max_running_requests": req.max_running_requests}  # fmt: skip
        fns.update(_compiled_stored("engine forward", forward, lambda i, n: (step(i, n), {}), info, notes)[0])
    if target.platform == "tpu" and attn == "native":
        notes.append(
            f"engine attention: sglang-jax 'native' on {target.device_kind} (its 'fa' kernel has block sizes "
            f"for TPU v{', v'.join(map(str, engine_layout.FA_TPU_VERSIONS))} only and raises for this one)"
        )
    if target.platform == "gpu":
        notes.append(
            "GPU: XLA's compiler does not reject a program that does not fit (the plan compares); "
            "a run sets XLA_PYTHON_CLIENT_PREALLOCATE=false (JAX would otherwise reserve 75% of the card "
            "at start), so phases allocate what they hold, as this plan counts"
        )
    info["host_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return Measured(target, comps, fns, notes, info)


def _engine_step(
    req: PlanRequest,
    devices: list[Any],
    target: Any,
    pool_tokens: int,
    attn: str,
    info: dict[str, Any],
    notes: list[str],
) -> FunctionMemory:
    """sglang-jax's forward while it generates: on TPU or GPU its prefill and decode compiled for
    the target (the larger extra bytes); on CPU, or where that compile fails, ``_engine_estimate``."""
    if target.platform == "cpu":
        notes.append(
            "engine forward: estimated from the shapes on CPU (a CPU run measures its engine at every "
            "phase; the forward is compiled for TPU and GPU targets)"
        )
        return _engine_estimate(req)
    if req.engine_forward == "estimate":
        notes.append("engine forward: estimated from the shapes (--engine-forward estimate)")
        return _engine_estimate(req)
    from mllm_rl.backends.jax import engine_compile

    rows = min(req.max_running_requests, req.prompts * req.group_size)
    layers = min(engine_compile.COMPILED_LAYERS, req.model.num_hidden_layers)
    best: FunctionMemory | None = None
    for shape in engine_compile.shapes(
        req.model, rows, req.seq_len, pool_tokens, req.max_running_requests, attn
    ):
        name = f"engine_{shape.mode}"
        detail = (
            f"sglang-jax Qwen3ForCausalLM forward, attention '{attn}', {shape.describe()}; compiled with "
            f"{layers} of {req.model.num_hidden_layers} layers (extra bytes do not grow with depth)"
        )
        lower = lambda s=shape: engine_compile.lower(req.model, devices, req.tp, attn, s, layers)  # noqa: E731
        key = ("engine_forward", req.target, req.model, req.tp, attn, shape, layers)
        try:
            c = _cached(key, lambda n=name, d=detail, lo=lower: _compile_lowered(n, lo, target, info, d))
        except Exception as e:  # noqa: BLE001 - a kernel that does not compile for the target is a finding
            line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            notes.append(
                f"engine forward NOT compiled for {target.name}: attention '{attn}' {shape.describe()}: "
                f"{type(e).__name__}: {line[:300]}; the rollout phases use the estimate"
            )
            return _engine_estimate(req)
        mem = c.memory
        if shape.cache_locs == shape.pool_tokens:
            info["engine_forward_pool_slots"] = pool_tokens  # read the whole pool: a bigger one reads more
        if mem.rejected:
            notes.append(f"engine forward ({shape.mode}) does not fit one device: {mem.rejected}")
        if best is None or mem.extra_bytes > best.extra_bytes:
            best = mem
        info.setdefault("engine_forward", {})[shape.mode] = {
            "peak_bytes": mem.peak_bytes,
            "extra_bytes": mem.extra_bytes,
            "shape": shape.describe(),
        }
    assert best is not None
    both = "; ".join(f"{k} {v['extra_bytes']} B extra" for k, v in info["engine_forward"].items())
    return dataclasses.replace(best, name="engine_step", detail=f"{best.detail} [{both}]")


def _engine_estimate(req: PlanRequest) -> FunctionMemory:
    """sglang-jax's forward step estimated from the shapes (``mllm_rl.memplan.engine_step``): a
    prefill chunk or a decode batch of at most ``max_running_requests`` rows, whichever is larger."""
    rows = min(req.max_running_requests, req.prompts * req.group_size)
    tokens = max(min(engine_layout.CHUNKED_PREFILL_TOKENS, rows * req.seq_len), rows)
    itemsize = 4 if engine_layout.engine_dtype(req.model) == "float32" else 2
    b, detail = forward_bytes(req.model, req.tp, tokens, rows, itemsize)
    return FunctionMemory("engine_step", b, 0, method="estimate", detail=detail)


def _compile_layer(req: PlanRequest, devices: list[Any], tokens: int) -> int | str:
    """One layer of the KV pool compiled for the target (its bytes), or the compiler's refusal."""
    try:
        return engine_layout.compile_layer(req.model, devices, req.tp, tokens)
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory refusal is expected
        rej = topologies.rejection(e)
        if rej is None:
            raise
        return rej[0]


def model_options(req: PlanRequest, platform: str) -> Any:
    """The trainer's ``ModelOptions`` on ``platform`` with ``req.options`` applied."""
    from mllm_rl.backends.jax.options import ModelOptions

    return ModelOptions.for_run(platform, tp=req.trainer_tp, options=req.options)


def _cached(key: tuple[Any, ...], make: Any) -> Any:
    if key not in _cache:
        _cache[key] = make()
    return _cache[key]


def _check_mesh(req: PlanRequest, n: int, hosts: int, name: str) -> None:
    """The engine's mesh (``--tp``) and the trainer's over ``n`` devices on ``hosts`` hosts."""
    c = req.model
    if req.tp > n:
        raise ValueError(f"--tp {req.tp}: {name} has {n} devices")
    if hosts > 1 and req.tp != n:
        raise ValueError(
            f"--tp {req.tp}: on {hosts} hosts the engine's mesh spans every device; pass --tp {n}"
        )
    if c.num_attention_heads % req.tp or c.num_key_value_heads % req.tp:
        raise ValueError(
            f"--tp {req.tp}: {c.num_attention_heads} heads / {c.num_key_value_heads} kv heads of "
            f"{c.name} are not divisible by it"
        )
    topologies.check_trainer_mesh(
        req.trainer_tp, req.fsdp, n, c.num_attention_heads, c.num_key_value_heads, name
    )


def _stored(
    what: str,
    args: dict[str, Any],
    make: Callable[[], dict[str, Any]],
    parse: Callable[[dict[str, Any]], Any],
    keep: Callable[[dict[str, Any]], bool] = lambda doc: True,
) -> tuple[Any, bool]:
    """``parse(make())`` (JSON-able figures), or ``parse`` of what a process running the same source
    and ``PACKAGES`` stored for the same ``args`` before (``mllm_rl.memplan.cache``; an entry that
    does not parse is made again and replaced); and whether it was stored. What ``keep`` refuses
    (a fallback that a transient failure may have caused) is not stored."""
    name = plan_cache.key({"what": what, "xla_flags": os.environ.get("XLA_FLAGS", ""), **args}, PACKAGES)
    doc = plan_cache.load(name)
    if doc is not None:
        try:
            return parse(doc), True
        except (KeyError, TypeError, ValueError, AttributeError):
            pass
    doc = make()
    if keep(doc):
        plan_cache.store(name, doc)
    return parse(doc), False


def _compiled_stored(
    what: str,
    args: dict[str, Any],
    compile_: Callable[[dict[str, Any], list[str]], tuple[dict[str, FunctionMemory], dict[str, Component]]],
    info: dict[str, Any],
    notes: list[str],
) -> tuple[dict[str, FunctionMemory], dict[str, Component]]:
    """``compile_(info, notes)``'s functions and components, or the plan cache's when this code
    compiled the same for the same ``args`` before (``_stored``); ``info`` and ``notes`` get what
    ``compile_`` adds to them; a stored compile shows as 0 seconds, "(cached)", and says so. Only
    compiled figures are stored, not an estimate standing in for a compile that failed."""

    def make() -> dict[str, Any]:
        sub_info: dict[str, Any] = {"compile_seconds": {}}
        sub_notes: list[str] = []
        fns, comps = compile_(sub_info, sub_notes)
        return {"functions": {k: dataclasses.asdict(f) for k, f in fns.items()},
                "components": {k: dataclasses.asdict(c) for k, c in comps.items()},
                "info": sub_info, "notes": sub_notes}  # fmt: skip

    def parse(doc: dict[str, Any]) -> tuple[Any, ...]:
        fns = {k: FunctionMemory(**f) for k, f in doc["functions"].items()}
        comps = {k: Component(**c) for k, c in doc["components"].items()}
        sub_info = dict(doc["info"])
        return fns, comps, dict(sub_info.pop("compile_seconds")), sub_info, list(doc["notes"])

    def compiled(doc: dict[str, Any]) -> bool:
        return all(f["method"] == "compiler" for f in doc["functions"].values())

    (fns, comps, seconds, sub_info, sub_notes), stored = _stored(what, args, make, parse, compiled)
    info.update(sub_info)
    notes.extend(sub_notes)
    if stored:
        fns = {k: dataclasses.replace(f, compile_seconds=0.0) for k, f in fns.items()}
        info["compile_seconds"].update({f"{k} (cached)": 0.0 for k in seconds})
        notes.append(
            f"{what}: figures compiled by an earlier process running the same code and compilers "
            "(the plan cache, MLLM_RL_PLAN_CACHE)"
        )
    else:
        info["compile_seconds"].update(seconds)
    return fns, comps


def _layer(doc: dict[str, Any]) -> int | str:
    """A stored KV layer's bytes, or the compiler's refusal."""
    if not isinstance(doc["layer"], int | str):
        raise TypeError(f"layer {doc['layer']!r}")
    return doc["layer"]


def _trainer(
    req: PlanRequest, devices: list[Any], target: Any, opts: Any, info: dict[str, Any], notes: list[str]
) -> tuple[dict[str, FunctionMemory], dict[str, Component]]:
    """Compile the trainer's functions; their FunctionMemory and the trainer's components."""
    import jax

    from mllm_rl.backends.jax.sharding import data_rows, make_mesh
    from mllm_rl.backends.jax.step_fns import (
        SCALAR,
        abstract_state,
        batch_specs,
        checkpoint_dtype,
        make_step_fns,
        resolve_dtypes,
        with_shardings,
    )

    loss = LossConfig(beta=KL_BETA if req.kl else 0.0)
    cfg = TrainConfig(
        micro_batch_size=req.micro_batch, lora_rank=req.lora_rank, precision=req.precision, loss=loss
    )
    dts = resolve_dtypes(cfg, opts, checkpoint_dtype(req.model))
    info["dtypes"] = {**dataclasses.asdict(dts), "precision": cfg.precision}
    if dts.trainable != dts.export:
        notes.append(
            f"trainer: {dts.trainable} master params and {dts.opt} AdamW moments of the {dts.export} "
            f"checkpoint (precision {cfg.precision}), computing in {dts.compute}"
            + (f", the frozen LoRA base in {dts.params}" if dts.lora else "")
            + f"; the engine gets {dts.export} casts"
        )
    mesh = make_mesh(opts.tp, devices)
    key = (req.target, req.model, req.lora_rank, req.kl, req.precision, opts)
    fns = _cached(("fns",) + key, lambda: make_step_fns(req.model, cfg, opts, mesh))
    state = _cached(("state",) + key, lambda: abstract_state(req.model, cfg, opts, mesh))
    trainable, frozen, opt_state = state
    seq = -(-req.seq_len // T_BUCKET) * T_BUCKET
    rows = data_rows(mesh, req.micro_batch)  # as the trainer pads it
    if rows != req.micro_batch:
        notes.append(
            f"micro-batch {req.micro_batch} is padded to {rows} rows, a multiple of the trainer's data "
            f"axis (fsdp {mesh.shape['fsdp']}), as the run pads it: split over the devices, not repeated"
        )
    mb = batch_specs(rows, seq, mesh, kl=req.kl)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    scalar = jax.ShapeDtypeStruct((), SCALAR.dtype, sharding=replicated)
    if seq != req.seq_len:
        notes.append(
            f"sequence length {req.seq_len} padded to {seq} (the trainer pads to multiples of {T_BUCKET})"
        )
    where = f"trainable + frozen shards on device 0, mesh fsdp={mesh.shape['fsdp']} x tp={mesh.shape['tp']}"
    host_opt = opts.optimizer_memory == "host"
    opt = "AdamW state shards on device 0"
    if host_opt:
        opt = (
            "AdamW state shards of device 0, in host memory for the whole run "
            "(optimizer_memory=host); the update streams them through the device a leaf at a time"
        )
    comps = {
        "trainer_params": Component("trainer_params", _shard_bytes((trainable, frozen)), "layout", where),
        "optimizer": Component(
            "optimizer", _shard_bytes(opt_state), "layout", opt, memory="host" if host_opt else "device"
        ),
    }
    if req.kl:  # the reference (initial params or zero adapters) on the device for train_step
        why = "KL reference: a copy of the trainable params' layout, on device in train_step"
        comps["ref_params"] = Component("ref_params", _shard_bytes(trainable), "layout", why)
    out: dict[str, FunctionMemory] = {}
    padded = f" ({req.micro_batch} padded)" if rows != req.micro_batch else ""
    mb_args = (trainable, frozen, mb, scalar, scalar)
    grad = _compile(
        "grad_step", fns.grad, mb_args, target, info, f"micro-batch {rows} x {seq} tokens{padded}"
    )
    out["grad_step"] = grad.memory
    grads_tree, how = trainable, "layout"
    why = "grad_step was rejected; gradients assumed sharded like the params"
    if grad.compiled is not None:  # the accumulator: grad_step's output layout in the trainable dtype
        grads_tree, how = with_shardings(trainable, grad.compiled.output_shardings[1]), "compiler"
        why = (
            "the gradient accumulator on one device: grad_step's output sharding, in the trainable "
            f"params' dtype ({dts.trainable}; grad_step returns {dts.compute})"
        )
    comps["grads"] = Component("grads", _shard_bytes(grads_tree), how, why)
    if host_opt:
        apply = lambda: _leaf_update(fns, trainable, opt_state, grads_tree, target, info)  # noqa: E731
    else:
        args, detail = (trainable, opt_state, grads_tree), "AdamW update, params and state donated"
        apply = lambda: _compile("optimizer_apply", fns.apply, args, target, info, detail).memory  # noqa: E731
    out["optimizer_apply"] = _cached(("apply",) + key, apply)
    if req.kl:  # the reference has the trainable params' shapes
        args = (trainable, frozen, mb["tokens"], mb["attn"])
        detail = f"reference log-probs, {req.micro_batch} x {seq}"
        out["logprob"] = _compile("logprob", fns.logprob, args, target, info, detail).memory
    return out, comps


def _leaf_update(
    fns: Any, trainable: Any, opt_state: Any, grads: Any, target: Any, info: dict[str, Any]
) -> FunctionMemory:
    """``optimizer_memory=host``: ``leaf_update`` compiled for the largest leaf (its streamed
    moments count in its extra bytes; param and gradient are resident components already)."""
    import jax

    from mllm_rl.backends.jax.host_optimizer import adam_state

    adam = adam_state(opt_state)
    leaves = zip(*map(jax.tree.leaves, (trainable, grads, adam.mu, adam.nu)), strict=True)
    p, g, m, v = max(leaves, key=_shard_bytes)
    scalar = jax.ShapeDtypeStruct((), adam.count.dtype, sharding=adam.count.sharding)
    norm = jax.ShapeDtypeStruct((), m.dtype, sharding=adam.count.sharding)
    detail = (
        f"AdamW update of one leaf {tuple(p.shape)} streamed from the host (optimizer_memory=host): "
        f"its moments, {_shard_bytes((m, v))} B per device, counted in its extra bytes"
    )
    mem = _compile(
        "optimizer_apply", fns.leaf_update, (p, g, m, v, scalar, norm), target, info, detail
    ).memory
    return dataclasses.replace(mem, argument_bytes=_shard_bytes((p, g)))


@dataclasses.dataclass
class _Compiled:
    memory: FunctionMemory
    compiled: Any


def _compile(
    name: str, fn: Any, args: tuple[Any, ...], target: Any, info: dict[str, Any], detail: str
) -> _Compiled:
    return _compile_lowered(name, lambda: fn.lower(*args), target, info, detail)


def _compile_lowered(name: str, lower: Any, target: Any, info: dict[str, Any], detail: str) -> _Compiled:
    """Compile what ``lower()`` returns for the target; its per-device memory (or the refusal)."""
    from mllm_rl.progress import waiting

    t0, compiled = time.perf_counter(), None
    try:
        with waiting(f"memory plan: compiling {name} for {target.name}"):
            compiled = lower().compile()
    except Exception as e:  # noqa: BLE001 - only the compiler's out-of-memory refusal is expected
        rej = topologies.rejection(e)
        if rej is None:
            raise
    secs = time.perf_counter() - t0
    info["compile_seconds"][name] = round(secs, 2)
    if compiled is None:
        line, need = rej
        peak = max(need, target.hbm_bytes + 1)
        mem = FunctionMemory(name, peak, 0, compile_seconds=secs, detail=detail, rejected=line)
        return _Compiled(mem, None)
    m = compiled.memory_analysis()
    arg, out, alias, temp = (
        int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp")
    )
    if target.platform == "cpu":
        peak = arg + out - alias + temp  # XLA:CPU reports no buffer reuse: an upper bound
    else:
        peak = int(m.peak_memory_in_bytes)
    mem = FunctionMemory(name, peak, arg, out, temp, alias, compile_seconds=secs, detail=detail)
    return _Compiled(mem, compiled)


def _shard_bytes(tree: Any) -> int:
    """Bytes of device 0's shards of the ``ShapeDtypeStruct`` leaves of ``tree``."""
    import jax
    import numpy as np

    return sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )

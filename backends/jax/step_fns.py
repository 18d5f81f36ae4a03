"""The JAX trainer's jitted step functions, as pure functions of abstract or real state.

``JaxTrainer`` runs exactly the functions of ``make_step_fns``; a planner compiles the same ones
for a target on the ``ShapeDtypeStruct`` trees of ``abstract_state`` / ``batch_specs``::

    mesh = make_mesh(opts.tp, devices)              # devices of the target (or jax.devices())
    fns = make_step_fns(model_cfg, train_cfg, opts, mesh)
    trainable, frozen, opt_state = abstract_state(model_cfg, train_cfg, opts, mesh)
    mb = batch_specs(B, T, mesh, kl=train_cfg.loss.beta > 0)
    fns.grad.lower(trainable, frozen, mb, SCALAR, SCALAR).compile().memory_analysis()

Shapes: B micro-batch rows, T positions (right-padded), V vocab. ``trainable`` / ``frozen``:
``nnx.State`` trees (full fine-tune: every ``Param`` / nothing; LoRA: the adapters / the base),
cast to the compute dtype inside the jitted functions; ``opt_state`` is sharded like them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from mllm_rl.backends.jax.model import (
    LoRAParam,
    Qwen3,
    Run,
    add_lora,
    cast_floats,
    head_logits,
    load_qwen3,
    model_dir_dtype,
    token_logprobs,
)
from mllm_rl.backends.jax.options import Dtypes, ModelOptions
from mllm_rl.backends.jax.rl_loss import policy_loss
from mllm_rl.backends.jax.sharding import batch_sharding, tree_shardings
from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.presets import ModelConfig
from mllm_rl.trainer import TrainConfig

SCALAR = jax.ShapeDtypeStruct((), jnp.float32)  # total_tokens / total_seqs of ``grad``


@dataclasses.dataclass(frozen=True)
class StepFns:
    graphdef: Any  # nnx graph definition: nnx.merge(graphdef, trainable, frozen) is the model
    dtypes: Dtypes  # what is stored, computed, optimised and exported in (ModelOptions.resolved)
    tx: optax.GradientTransformation
    logprob: Callable[..., Any]  # -> [B, T - 1] tempered log-probs
    next_logits: Callable[..., Any]  # -> [B, V] untempered
    grad: Callable[..., Any]  # -> ((loss, token-summed metrics), grads in the compute dtype)
    start_acc: Callable[..., Any]
    accumulate: Callable[..., Any]
    apply: Callable[..., Any]  # -> (trainable, opt_state, grad_norm), donating both
    grad_norm: Callable[..., Any]
    leaf_update: Callable[..., Any]  # ``apply`` for one leaf (host_optimizer.py)


def _adamw(cfg: TrainConfig) -> optax.GradientTransformation:
    return optax.adamw(cfg.lr, b1=cfg.adam_b1, b2=cfg.adam_b2, weight_decay=cfg.weight_decay)


def make_tx(cfg: TrainConfig, opt_dtype: str | None = None) -> optax.GradientTransformation:
    """The optimizer: global-norm clipping (when ``grad_clip > 0``), then AdamW. With ``opt_dtype``
    the moments live in that dtype and grads and params are cast to it before the update."""
    base = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
        _adamw(cfg),
    )
    if opt_dtype is None:
        return base
    odt = jnp.dtype(opt_dtype)
    cast = lambda tree: jax.tree.map(lambda a: a.astype(odt), tree)  # noqa: E731

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return base.update(cast(grads), state, None if params is None else cast(params))

    return optax.GradientTransformation(lambda params: base.init(cast(params)), update)


def checkpoint_dtype(model_cfg: ModelConfig) -> jnp.dtype:
    """The dtype a checkpoint of ``model_cfg`` stores (its ``torch_dtype``)."""
    return jnp.dtype(model_cfg.torch_dtype)


def resolve_dtypes(train_cfg: TrainConfig, opts: ModelOptions, dtype: Any) -> Dtypes:
    """``opts.resolved`` for a checkpoint of ``dtype`` under ``train_cfg`` (precision, LoRA)."""
    return opts.resolved(dtype, train_cfg.precision, lora=train_cfg.lora_rank > 0)


def _split(model: Qwen3, lora: bool) -> tuple[Any, Any, Any]:
    return nnx.split(model, LoRAParam, ...) if lora else nnx.split(model, nnx.Param, ...)


def _with_lora(model: Qwen3, train_cfg: TrainConfig, dts: Dtypes) -> Qwen3:
    if train_cfg.lora_rank > 0:
        add_lora(model, train_cfg.lora_rank, train_cfg.lora_alpha, train_cfg.seed, jnp.dtype(dts.adapters))
    return model


def abstract_model(
    model_cfg: ModelConfig, train_cfg: TrainConfig, opts: ModelOptions, dtype: Any = None
) -> tuple[Any, Any, Any]:
    """(graphdef, trainable, frozen) with ``ShapeDtypeStruct`` leaves; ``dtype``: the checkpoint's."""
    dtype = checkpoint_dtype(model_cfg) if dtype is None else dtype
    dts = resolve_dtypes(train_cfg, opts, dtype)
    model = nnx.eval_shape(
        lambda: _with_lora(Qwen3(model_cfg, jnp.dtype(dts.params), opts.scan_layers), train_cfg, dts)
    )
    return _split(model, train_cfg.lora_rank > 0)


def with_shardings(tree: Any, shardings: Any) -> Any:
    """``tree``'s leaves as ``ShapeDtypeStruct``s carrying ``shardings`` (a tree like it)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def abstract_state(
    model_cfg: ModelConfig, train_cfg: TrainConfig, opts: ModelOptions, mesh: Mesh, dtype: Any = None
) -> tuple[Any, Any, Any]:
    """(trainable, frozen, opt_state) as ``ShapeDtypeStruct`` trees with the trainer's shardings."""
    dtype = checkpoint_dtype(model_cfg) if dtype is None else dtype
    _, trainable, frozen = abstract_model(model_cfg, train_cfg, opts, dtype)
    opt_state = jax.eval_shape(make_tx(train_cfg, resolve_dtypes(train_cfg, opts, dtype).opt).init, trainable)
    return tuple(with_shardings(t, tree_shardings(t, mesh)) for t in (trainable, frozen, opt_state))


def batch_specs(rows: int, seq_len: int, mesh: Mesh, kl: bool = False) -> dict[str, jax.ShapeDtypeStruct]:
    """The micro-batch ``grad`` takes: [B, T] ``tokens`` int32, ``attn``/``loss_mask`` bool,
    ``old_logp``/``is_weight`` (with KL ``ref_logp``) float32; ``adv`` [B] float32."""
    sh = batch_sharding(mesh, rows)
    dtypes = {"tokens": jnp.int32, "attn": jnp.bool_, "loss_mask": jnp.bool_, "old_logp": jnp.float32}
    dtypes |= {"is_weight": jnp.float32, "adv": jnp.float32} | ({"ref_logp": jnp.float32} if kl else {})
    return {
        k: jax.ShapeDtypeStruct((rows,) if k == "adv" else (rows, seq_len), jnp.dtype(dt), sharding=sh)
        for k, dt in dtypes.items()
    }


def load_state(
    model_dir: ModelDir, train_cfg: TrainConfig, opts: ModelOptions, mesh: Mesh
) -> tuple[Any, Any, Any]:
    """The real (graphdef, trainable, frozen) of ``model_dir``, placed as ``abstract_state`` says."""
    dtype = model_dir_dtype(model_dir)
    dts = resolve_dtypes(train_cfg, opts, dtype)
    model = _with_lora(load_qwen3(model_dir, jnp.dtype(dts.params), opts.scan_layers), train_cfg, dts)
    graphdef, trainable, frozen = _split(model, train_cfg.lora_rank > 0)
    del model
    _, want_t, want_f = abstract_model(model_dir.config, train_cfg, opts, dtype)
    for got, want in ((trainable, want_t), (frozen, want_f)):
        if jax.tree.structure(got) != jax.tree.structure(want):
            raise ValueError(f"{model_dir.path}: loaded state does not match the model's abstract state")
    place = lambda t: jax.tree.map(jax.device_put, t, tree_shardings(t, mesh))  # noqa: E731
    return graphdef, place(trainable), place(frozen)


def make_run(opts: ModelOptions, mesh: Mesh, compute: str | None = None) -> Run:
    """How the forward runs on ``mesh``'s platform: ``splash`` is a TPU kernel (interpreted on CPU,
    refused elsewhere). ``compute``: the resolved compute dtype (default ``opts.compute_dtype``)."""
    platform = mesh.devices.flat[0].platform
    if opts.attention == "splash" and platform not in ("tpu", "cpu"):
        raise ValueError(
            f"ModelOptions.attention='splash' is a TPU kernel; on {platform} use 'chunked' or 'xla'"
        )
    if compute is not None:
        opts = dataclasses.replace(opts, compute_dtype=compute)
    return Run(opts, mesh, interpret=opts.attention == "splash" and platform == "cpu")


def make_step_fns(
    model_cfg: ModelConfig,
    train_cfg: TrainConfig,
    opts: ModelOptions,
    mesh: Mesh,
    dtype: Any = None,
) -> StepFns:
    """The trainer's jitted functions for the devices of ``mesh``; ``dtype``: the checkpoint's."""
    dtype = checkpoint_dtype(model_cfg) if dtype is None else dtype
    dts = resolve_dtypes(train_cfg, opts, dtype)
    graphdef, abs_trainable, _ = abstract_model(model_cfg, train_cfg, opts, dtype)
    loss_cfg = train_cfg.loss
    tx = make_tx(train_cfg, dts.opt)
    run = make_run(opts, mesh, dts.compute)
    # gradients, params and optimizer state pinned to the params' layout (else XLA may shard less)
    t_sh = tree_shardings(abs_trainable, mesh)
    o_sh = tree_shardings(jax.eval_shape(tx.init, abs_trainable), mesh)
    pin = jax.lax.with_sharding_constraint
    cdt = jnp.dtype(dts.compute)
    temperature = train_cfg.temperature

    def merged(trainable: Any, frozen: Any) -> Qwen3:
        """The model cast to the compute dtype once (less memory than a cast per layer in the scan)."""
        return nnx.merge(graphdef, cast_floats(trainable, cdt), cast_floats(frozen, cdt))

    def token_logp_of(model: Qwen3, tokens: jax.Array, attn: jax.Array) -> jax.Array:
        x = model.hidden(tokens, attn, run)  # [B, T, H]; the last position predicts nothing
        targets = jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))
        head = model.head().astype(cdt)
        return token_logprobs(x, head, targets, opts.logprob_chunk, temperature)[:, :-1]

    def token_logp(trainable: Any, frozen: Any, tokens: jax.Array, attn: jax.Array) -> jax.Array:
        """[B, T] -> log softmax(logits / temperature)[tokens[:, t]] given tokens[:, :t], [B, T - 1]."""
        return token_logp_of(merged(trainable, frozen), tokens, attn)

    def next_logits(
        trainable: Any, frozen: Any, tokens: jax.Array, attn: jax.Array, pos: jax.Array
    ) -> jax.Array:
        """Untempered logits [B, V] float32 of the token after position ``pos`` (greedy probe)."""
        model = merged(trainable, frozen)
        x = jax.lax.dynamic_index_in_dim(model.hidden(tokens, attn, run), pos, axis=1, keepdims=False)
        return head_logits(x, model.head().astype(cdt))

    def loss_fn(cast_trainable, cast_frozen, mb, total_tokens, total_seqs):
        """The loss of the params already in the compute dtype."""
        logp = token_logp_of(nnx.merge(graphdef, cast_trainable, cast_frozen), mb["tokens"], mb["attn"])
        mask = mb["loss_mask"][:, 1:]
        ref = mb["ref_logp"][:, 1:] if loss_cfg.beta > 0 else None
        loss, m = policy_loss(
            logp,
            mb["old_logp"][:, 1:],
            mb["adv"],
            mask,
            loss_cfg,
            ref_logp=ref,
            total_tokens=total_tokens,
            total_seqs=total_seqs,
            is_weight=mb["is_weight"][:, 1:],
        )
        n = mask.astype(jnp.float32).sum()
        sums = {k: v * n for k, v in m.items()}  # token-weighted, summed over micro-batches
        sums["tokens"] = n
        sums["entropy_proxy"] = -(logp * mask).sum()  # sum of -log p of the taken tokens
        return loss, sums

    odt = jnp.dtype(dts.opt)
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

    def grad(trainable, frozen, mb, total_tokens, total_seqs):
        """The gradient w.r.t. the params' compute-dtype casts, in that dtype."""
        cast_t, cast_f = cast_floats(trainable, cdt), cast_floats(frozen, cdt)
        out, grads = value_and_grad(cast_t, cast_f, mb, total_tokens, total_seqs)
        return out, pin(grads, t_sh)

    def start_acc(grads, trainable):
        """The accumulator of a mini-batch: its first gradient in the trainable params' dtype."""
        return pin(jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trainable), t_sh)

    def accumulate(acc, grads):
        return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)

    def grad_norm(grads):
        return optax.global_norm(jax.tree.map(lambda g: g.astype(odt), grads))

    def apply(trainable, opt_state, grads):
        gnorm = grad_norm(grads)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return pin(optax.apply_updates(trainable, updates), t_sh), pin(opt_state, o_sh), gnorm

    adamw = _adamw(train_cfg)

    def leaf_update(param, grad, mu, nu, count, gnorm):
        """``apply`` for one leaf: ``make_tx``'s cast, optax's clip with the global norm given, the
        same AdamW on a one-leaf state, ``optax.apply_updates``."""
        g = grad.astype(odt)
        if train_cfg.grad_clip > 0:  # optax.clip_by_global_norm's update, its norm precomputed
            g = jax.lax.select(gnorm < train_cfg.grad_clip, g, (g / gnorm.astype(odt)) * train_cfg.grad_clip)
        p = param.astype(odt)
        state = jax.tree.unflatten(jax.tree.structure(adamw.init(p)), [count, mu, nu])
        update, state = adamw.update(g, state, p)
        count, mu, nu = jax.tree.leaves(state)
        return optax.apply_updates(param, update), mu, nu, count

    return StepFns(
        graphdef=graphdef,
        dtypes=dts,
        tx=tx,
        logprob=jax.jit(token_logp),
        next_logits=jax.jit(next_logits),
        grad=jax.jit(grad),
        start_acc=jax.jit(start_acc),
        accumulate=jax.jit(accumulate, donate_argnums=0),
        apply=jax.jit(apply, donate_argnums=(0, 1)),
        grad_norm=jax.jit(grad_norm),
        leaf_update=jax.jit(leaf_update, donate_argnums=(0, 2, 3)),
    )

"""The memory plan a run makes for its own devices before any engine starts (docs/PLAN.md).

``--memory-plan check``: a plan that does not fit exits 6 before anything of the run exists; one
that fits is written as ``plan.json``/``plan.txt`` (audited by ``mllm_rl.memplan.audit``);
``--kv-tokens auto`` takes the largest KV pool that fits. The target is the planner's
``target_for_runtime``, planned in a fresh process unless the planner plans in process (the planner
needs a JAX on its CPU platform, which a TPU/GPU run's process cannot become): ``python -m
mllm_rl.memplan.for_run`` reads the request as JSON on stdin and writes one JSON object on stdout:
``{"plan": ...}``, ``{"does_not_fit": ...}`` or ``{"error": ...}``."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

from mllm_rl.memplan.compose import host_line
from mllm_rl.memplan.request import PlanRequest
from mllm_rl.presets import ModelConfig


class DoesNotFit(Exception):
    """The run's own plan does not fit its devices (exit 6, before anything starts)."""


def target_for(backend: str, runtime: dict[str, Any]) -> str | None:
    """The planner target of the runtime's devices (``target_for_runtime``), or None."""
    from mllm_rl.memplan.planner import load_planner

    try:
        planner = load_planner(backend)
    except ValueError:
        return None
    fn = getattr(planner, "target_for_runtime", None)
    return fn(runtime) if fn is not None else None


def request_for(backend: str, target: str, model: Any, opts: Any, engine: str = "auto") -> PlanRequest:
    """The plan request of an RL run; ``engine``: the rollout engine it starts."""
    train, eng = opts.train, opts.engine
    rows = opts.prompts_per_step * opts.group_size // max(1, train.mini_batches)
    return PlanRequest(
        backend=backend,
        target=target,
        model=model.config,
        micro_batch=max(1, min(train.micro_batch_size, rows)),
        seq_len=int(eng.context_length),
        group_size=opts.group_size,
        prompts=opts.prompts_per_step,
        tp=eng.tp,
        lora_rank=train.lora_rank,
        kl=train.loss.beta > 0,
        precision=train.precision,
        schedule=opts.lifecycle.schedule,
        kv_tokens=eng.max_total_tokens,
        mem_fraction_static=eng.mem_fraction_static,
        param_dtype=model.config.torch_dtype,
        max_running_requests=eng.max_running_requests or 128,
        trainer_tp=train.trainer_tp,
        fsdp=train.fsdp,
        options=dict(train.model_options),
        engine=engine,
        weights_cpu_backup=eng.weights_cpu_backup,
        checkpoint_background=bool(opts.checkpoint_background and opts.checkpoint_every),
    )


def _host_ram_gib(runtime: dict[str, Any]) -> float | None:
    """This host's RAM for a TPU or GPU target's host verdict (cpu/cuda targets know it already)."""
    if runtime.get("platform") not in ("tpu", "gpu"):
        return None
    import psutil

    return psutil.virtual_memory().total / 2**30


# the run's device and cluster settings: the child compiles for a target and joins no process group
DROPPED_ENV_PREFIXES = ("TPU_", "JAX_", "XLA_", "MEGASCALE_", "CUDA_VISIBLE_DEVICES", "TORCHELASTIC_")
DROPPED_ENV = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                         "MASTER_PORT", "MLLM_RL_COORDINATOR", "MLLM_RL_NUM_PROCESSES", "MLLM_RL_PROCESS_ID"})  # fmt: skip


def child_env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if not k.startswith(DROPPED_ENV_PREFIXES) and k not in DROPPED_ENV
    }


def run_child(req: PlanRequest, check_weights: bool, fit_kv: bool, timeout: float = 3600) -> dict[str, Any]:
    """The fresh process's answer (``main``); ``RuntimeError`` naming its exit and last lines if none."""
    payload = json.dumps(
        {"request": dataclasses.asdict(req), "check_weights": check_weights, "fit_kv": fit_kv}
    )
    r = subprocess.run(
        [sys.executable, "-m", "mllm_rl.memplan.for_run"],
        input=payload,
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=timeout,
    )
    lines = r.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = " | ".join(r.stderr.strip().splitlines()[-3:])
        raise RuntimeError(f"memory plan process exited {r.returncode} without a plan: {tail}") from None


@dataclasses.dataclass
class RunPlan:
    """A run's plan: ``plan.json`` (``doc``), its text; the KV pool planned and the fraction that builds it."""

    doc: dict[str, Any]
    text: str
    verdict: str
    kv_tokens: int | None
    mem_fraction_static: float | None
    host: str = ""  # the host-memory line (compose.host_line)


def plan_run(req: PlanRequest, check_weights: bool, fit_kv: bool, in_process: bool = False) -> RunPlan:
    """Measure and compose ``req`` (``fit_kv``: with the largest KV pool); ``DoesNotFit`` naming phase
    and component, ``ValueError`` for a refused request. In a child unless planned in process."""
    from mllm_rl.memplan import output
    from mllm_rl.memplan.planner import fit_kv as fit_pool
    from mllm_rl.memplan.planner import load_planner, plans

    planner = load_planner(req.backend)
    here = getattr(planner, "plans_in_process", None)
    if not in_process and here is not None and not here(req.target):
        answer = run_child(req, check_weights, fit_kv)
        if "does_not_fit" in answer:
            raise DoesNotFit(answer["does_not_fit"])
        if "error" in answer:
            raise ValueError(answer["error"])
        return RunPlan(**answer["plan"])
    m = planner.measure(req)
    extra: dict[str, Any] = {"for_run": True}
    if fit_kv:
        m, req, room, phase = fit_pool(m, req, check_weights, req.kv_fit_cap)
        if room < 1:
            raise DoesNotFit(f"memory plan: no room for a KV pool in {phase} (--kv-tokens auto)")
        extra["kv_fit"] = {"tokens": req.kv_tokens, "room_tokens": room, "cap_tokens": req.kv_fit_cap,
                           "tightest_phase": phase}  # fmt: skip
    result = plans(m, req, check_weights)
    run_plan = result[req.schedule]
    summary = [output.verdict(p) for p in result.values()]
    verdict = output.verdict(run_plan)
    doc = output.document(result, m, summary, extra)
    text = output.render(result, m, summary)
    if not run_plan.fits:
        raise DoesNotFit(f"memory plan ({req.target}, predicted): {verdict}")
    kv_tokens, fraction = m.info.get("kv_tokens", req.kv_tokens), m.info.get("mem_fraction_static")
    return RunPlan(doc, text, verdict, kv_tokens, fraction, host_line(run_plan))


def write_plan_files(run_dir: Any, run_plan: RunPlan) -> None:
    """``plan.json`` and ``plan.txt`` next to the run's ``phases.jsonl``."""
    (run_dir / "plan.json").write_text(json.dumps(run_plan.doc, indent=2, default=str) + "\n")
    (run_dir / "plan.txt").write_text(run_plan.text)


def plan_for_rl(
    backend: Any, model: Any, opts: Any, runtime: dict[str, Any], sized: Any
) -> tuple[Any, RunPlan | None, list[str]]:
    """``RLPlan.memory_plan``: ``opts`` with its engine sized (``sized(opts)``, plus the fitted pool
    with ``--kv-tokens auto``), the plan, and lines to tell the user."""
    mode = opts.memory_plan
    target = target_for(backend.name, runtime) if mode != "off" else None
    if target is None:
        where = f"{backend.name} on {runtime.get('platform')}"
        if opts.kv_auto:
            why = "--memory-plan off" if mode == "off" else f"no plan target for {where}"
            raise ValueError(
                f"--kv-tokens auto: sized by the run's memory plan, and there is none ({why}); pass --kv-tokens N"
            )
        if mode == "off":
            return opts, None, []
        procs = runtime.get("process_count", 1)
        kind = (
            runtime.get("device_kind")
            and f" ({runtime['device_kind']} x {runtime.get('global_device_count')})"
        )
        note = (
            f"memory plan: not made before start-up for {where}{f' ({procs} processes)' if procs > 1 else ''}"
            f"{kind or ''} (no plan target for these devices: a run plans itself for JAX on one CPU process, "
            "a TPU slice or an NVIDIA H100/H200 node, torch on CPU or CUDA processes of this machine); "
            f"python -m mllm_rl.memplan --backend {backend.name} --target ... plans it with the same flags"
        )
        return opts, None, [note]
    engine = sized(opts)
    # On CPU every engine step pays for the pool (a donated pool is rewritten per forward), so
    # auto takes at most the run's own pool (its requests x context); on an accelerator, the room left.
    on_cpu = runtime.get("platform") == "cpu"
    cap = engine.max_total_tokens if on_cpu else None
    if opts.kv_auto:  # the plan sizes the pool, not the run's requests x context rule
        engine = dataclasses.replace(engine, max_total_tokens=None)
    opts = dataclasses.replace(opts, engine=engine)
    req = request_for(backend.name, target, model, opts, backend.rollout_engine(opts.engine.engine))
    cap = cap if opts.kv_auto else None
    req = dataclasses.replace(
        req, margin=opts.plan_margin, host_ram_gib=_host_ram_gib(runtime), kv_fit_cap=cap
    )
    from mllm_rl.progress import waiting

    try:
        with waiting(f"memory plan: compiling the step functions for {target}"):
            plan = plan_run(req, opts.lifecycle.check_weights, fit_kv=opts.kv_auto)
    except DoesNotFit as e:
        if mode == "check":
            raise DoesNotFit(
                f"{e} (--memory-plan warn runs anyway; python -m mllm_rl.memplan shows the table)"
            ) from None
        return opts, None, [f"warning: {e}; running anyway (--memory-plan warn)"]
    notes = [
        f"{plan.verdict} (memory plan, predicted for {target}; plan.json in the run directory)",
        plan.host,
    ]
    if opts.kv_auto:
        engine = dataclasses.replace(opts.engine, max_total_tokens=plan.kv_tokens)
        # on CPU the adapter's high default fraction only relaxes sglang-jax's start-up check (the
        # pool is capped by max_total_tokens); the plan's minimum fraction fails it on a busy host
        if plan.mem_fraction_static is not None and engine.mem_fraction_static is None and not on_cpu:
            engine = dataclasses.replace(engine, mem_fraction_static=plan.mem_fraction_static)
        opts = dataclasses.replace(opts, engine=engine)
        why = (
            "the run's requests x context on CPU, within the room the plan leaves"
            if req.kv_fit_cap is not None
            else "the largest the plan leaves room for"
        )
        notes.append(f"--kv-tokens auto: a KV pool of {plan.kv_tokens} tokens ({why})")
    return opts, plan, notes


def main() -> int:
    data = json.loads(sys.stdin.read())
    req = PlanRequest(**{**data["request"], "model": ModelConfig(**data["request"]["model"])})
    try:
        plan = plan_run(req, bool(data["check_weights"]), bool(data["fit_kv"]), in_process=True)
        out: dict[str, Any] = {"plan": dataclasses.asdict(plan)}
    except DoesNotFit as e:
        out = {"does_not_fit": str(e)}
    except (ValueError, RuntimeError) as e:
        out = {"error": str(e)}
    print(json.dumps(out, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

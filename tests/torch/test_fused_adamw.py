"""The torch trainer's ``--model-option adamw=auto|foreach|fused`` (``backends/torch/options.py``,
``backends/torch/trainer.py``): ``fused`` steps the same weights as ``foreach`` to float32 rounding
(float32 and bf16 mixed precision, LoRA included), through everything the trainer does to the
optimizer state (offload / onload, save / restore / resume, across implementations); the planner
traces the fused kernel and counts no AdamW temporaries for it; bad values are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mllm_rl.backends.torch import memplan
from mllm_rl.backends.torch.options import TorchModelOptions, adamw_name
from mllm_rl.backends.torch.trainer import TorchTrainer, _step_device
from mllm_rl.presets import get_preset
from mllm_rl.rl.loss_config import LossConfig
from mllm_rl.trainer import OPTIMIZER, PARAMS, TrainConfig
from tests.conftest import run_cli
from tests.torch.test_activation_checkpointing import CFG, batch, random_model

pytestmark = pytest.mark.usefixtures("one_thread")

FUSED = (("adamw", "fused"),)
FOREACH = (("adamw", "foreach"),)
# float32 rounding: fused and foreach order the AdamW arithmetic differently (seen: 1 ulp, at most
# 1.2e-7 on the ~1.0 norm weights after 3 steps)
F32 = {"rtol": 1e-6, "atol": 1e-7}
STEPS = 3


def make(
    dtype: str = "float32", options=(), lora_rank: int = 0, precision: str = "mixed", device: str = "cpu"
) -> TorchTrainer:
    """A trainer over ``random_model`` (seed 0) with a checkpoint dtype ``dtype`` (bf16 + ``mixed``:
    float32 masters computing in bf16), KL on, lr 1e-2 (steps that move every weight)."""
    cfg = TrainConfig(
        lr=1e-2,
        micro_batch_size=2,
        lora_rank=lora_rank,
        precision=precision,
        loss=LossConfig(beta=0.05),
        model_options=options,
    )
    model = random_model().to(getattr(torch, dtype)).to(device)
    return TorchTrainer(memplan.layout_dir(CFG, dtype), cfg, device=device, model=model)


def weights(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in t.trainable.items()}


def moments(t: TorchTrainer) -> list[torch.Tensor]:
    return [st[k].clone() for st in t.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[n].float() - b[n].float()).abs().max()) for n in a)


def run(t: TorchTrainer, steps: int = STEPS, replay: list[list[torch.Tensor]] | None = None):
    """``steps`` ``train_step``s (batch seed = step index); the gradients each AdamW step got (after
    clipping) and the weights after each step. ``replay``: another run's gradients, written into
    the params' ``.grad`` just before each AdamW step (the trainer computes its own first)."""
    seen: list[list[torch.Tensor]] = []
    step = t.optimizer.step

    def capturing_step() -> None:
        if replay is not None:
            for p, g in zip(t.trainable.values(), replay[len(seen)], strict=True):
                p.grad.copy_(g)
        seen.append([p.grad.clone() for p in t.trainable.values()])
        step()

    t.optimizer.step = capturing_step  # type: ignore[method-assign]
    after = []
    for i in range(t.step, t.step + steps):
        t.train_step(batch(seed=i))
        after.append(weights(t))
    del t.optimizer.step  # the class's again
    return seen, after


@pytest.fixture
def spy(monkeypatch):
    """Counts the calls of torch's fused and foreach AdamW implementations."""
    import torch.optim.adam as adam

    calls = {"fused": 0, "foreach": 0, "single": 0}
    for name, key in (
        ("_fused_adam", "fused"),
        ("_multi_tensor_adam", "foreach"),
        ("_single_tensor_adam", "single"),
    ):
        real = getattr(adam, name)

        def counting(*a, _real=real, _key=key, **kw):
            calls[_key] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(adam, name, counting)
    return calls


# -- exactness ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, lora_rank",
    [("float32", 0), ("bfloat16", 0), ("bfloat16", 4)],
    ids=["fp32", "bf16_mixed", "bf16_mixed_lora"],
)
def test_fused_steps_equal_foreach(dtype, lora_rank, spy):
    """``STEPS`` trainer steps (two micro-batches each, KL, clipping) with ``adamw=fused`` vs
    ``adamw=foreach``: the first step's gradients are identical; the fused run gets the foreach
    run's gradients replayed (from the second step on its own would differ: a 1-ulp weight change
    flips bf16 roundings in the forward, and AdamW's m / sqrt(v) turns a flipped sign of a tiny
    gradient into a +-lr update), so what is compared is the optimizer's arithmetic: the weights
    and moments after every step agree to float32 rounding."""
    ref, fused = make(dtype, FOREACH, lora_rank), make(dtype, FUSED, lora_rank)
    assert [g["fused"] for g in fused.optimizer.param_groups] == [True]
    assert [g["foreach"] for g in ref.optimizer.param_groups] == [True]
    assert spy == {"fused": 1, "foreach": 1, "single": 0}  # _init_optimizer_state's lr-0 steps
    g0, w0 = run(ref)
    assert spy == {"fused": 1, "foreach": 1 + STEPS, "single": 0}
    g1, w1 = run(fused, replay=g0)
    assert spy["fused"] == 1 + STEPS and spy["foreach"] == 1 + STEPS
    for a, b in zip(g0[0], g1[0], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0)  # same start: the same gradients
    for s, (a, b) in enumerate(zip(w0, w1, strict=True)):
        assert max_diff(a, b) > 0 or s == 0 or lora_rank  # a different arithmetic, not the same code
        for n in a:
            assert a[n].dtype == torch.float32
            torch.testing.assert_close(b[n], a[n], **F32, msg=f"step {s + 1}: {n}")
    for a, b in zip(moments(ref), moments(fused), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-12)
    for st in fused.optimizer.state.values():
        assert st["step"].dtype == torch.float32 and float(st["step"]) == STEPS


def test_auto_is_torchs_default_choice_off_cuda(spy):
    """``auto`` (the default) off CUDA passes neither argument: on CPU torch loops over the tensors
    (``_single_tensor_adam``), bit-identical to foreach here."""
    t = make()
    assert TorchModelOptions().adamw == "auto" and t.options.adamw == "auto"
    assert [(g["foreach"], g["fused"]) for g in t.optimizer.param_groups] == [(None, None)]
    _, w = run(t, steps=1)
    assert spy == {"fused": 0, "foreach": 0, "single": 2}
    _, w_foreach = run(make(options=FOREACH), steps=1)
    assert max_diff(w[0], w_foreach[0]) == 0


def test_auto_is_fused_on_cuda():
    """``auto`` means ``fused`` for parameters on a CUDA device (faster and without foreach's
    full-size step temporaries on an H100); the explicit choices stay what they say."""
    assert TorchModelOptions().adamw_on("cuda") == "fused"
    assert TorchModelOptions().adamw_kwargs("cuda") == {"fused": True}
    assert TorchModelOptions().adamw_kwargs("cpu") == {}
    for name in ("foreach", "fused"):
        assert (
            TorchModelOptions(adamw=name).adamw_on("cuda")
            == TorchModelOptions(adamw=name).adamw_on("cpu")
            == name
        )


def test_auto_trainer_on_cuda_steps_fused():
    from tests.torch.conftest import needs_cuda

    needs_cuda()
    t = make(device="cuda")
    assert [(g["foreach"], g["fused"]) for g in t.optimizer.param_groups] == [(None, True)]


def test_pure_bf16_fused_is_within_one_bf16_rounding():
    """``precision=pure`` (bf16 params and moments): foreach rounds every op to bf16, the fused
    kernel computes in float32 and rounds once, so they differ by bf16 roundings, not float32
    ones: at most one bf16 ulp of the weight (2^-7 relative) plus two of the ~lr-sized update
    (2 x 1e-2 x 2^-7 = 1.6e-4; seen 1.2e-4, on weights the update takes across 0)."""
    ref, fused = make("bfloat16", FOREACH, precision="pure"), make("bfloat16", FUSED, precision="pure")
    g0, w0 = run(ref, steps=1)
    _, w1 = run(fused, steps=1, replay=g0)
    for n, a in w0[0].items():
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(w1[0][n], a, rtol=2**-7, atol=1.6e-4, msg=n)


def test_state_init_leaves_the_params_bit_exact():
    """``_init_optimizer_state`` runs one fused step at lr 0: every param unchanged, moments 0,
    step counters 0 (float32, on the params' device)."""
    before = {n: p.detach().clone() for n, p in random_model().named_parameters()}
    t = make(options=FUSED)
    for n, p in t.trainable.items():
        assert torch.equal(p.detach(), before[n]), n
    for p, st in t.optimizer.state.items():
        assert not st["exp_avg"].any() and not st["exp_avg_sq"].any()
        assert st["step"].dtype == torch.float32 and st["step"].device == p.device and float(st["step"]) == 0


# -- offload, checkpoints -------------------------------------------------------------------------
def test_offload_onload_then_step_equals_an_uninterrupted_run():
    """Fused step counters are optimizer state on the device: offloaded (storages 0) and onloaded
    with the moments, and the steps after continue bit for bit."""
    a, b = make(options=FUSED), make(options=FUSED)
    run(a, steps=1)
    run(b, steps=1)
    held = b.state_bytes()
    steps = [st["step"] for st in b.optimizer.state.values()]
    assert held[OPTIMIZER] == 2 * held[PARAMS] + 4 * len(steps)  # exp_avg, exp_avg_sq (float32), 4 B steps
    assert b.offload([PARAMS, OPTIMIZER]) == held[PARAMS] + held[OPTIMIZER]
    assert all(s.untyped_storage().nbytes() == 0 for s in steps)
    assert b.onload([PARAMS, OPTIMIZER]) == held[PARAMS] + held[OPTIMIZER]
    assert [float(s) for s in steps] == [1.0] * len(steps)
    _, wa = run(a, steps=2)
    _, wb = run(b, steps=2)
    assert max_diff(wa[-1], wb[-1]) == 0
    assert all(torch.equal(x, y) for x, y in zip(moments(a), moments(b), strict=True))


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_save_restore_resume_equals_an_uninterrupted_run(tmp_path, lora_rank):
    """Save after step 1, restore into a fresh fused trainer, step: bit-equal to a run that never
    stopped; the restored counters are float32 on the params' device, in their own storages
    (offload resizes them)."""
    a = make(options=FUSED, lora_rank=lora_rank)
    run(a, steps=1)
    a.save(tmp_path)
    _, wa = run(a, steps=1)
    b = make(options=FUSED, lora_rank=lora_rank)
    b.restore(tmp_path)
    assert b.step == 1 and [g["fused"] for g in b.optimizer.param_groups] == [True]
    for p, st in b.optimizer.state.items():
        assert st["step"].dtype == torch.float32 and st["step"].device == p.device and float(st["step"]) == 1
    b.offload([OPTIMIZER])
    b.onload([OPTIMIZER])
    _, wb = run(b, steps=1)
    assert max_diff(wa[0], wb[0]) == 0
    assert all(torch.equal(x, y) for x, y in zip(moments(a), moments(b), strict=True))


@pytest.mark.parametrize("saved, resumed", [(FOREACH, FUSED), (FUSED, ()), ((), FUSED)])
def test_resume_keeps_the_resuming_trainers_implementation(tmp_path, saved, resumed, spy):
    """``load_state_dict`` would take the saved param groups' ``foreach``/``fused``: the restored
    trainer keeps its own ``adamw`` and puts the step counters where that implementation keeps
    them; it then steps what an uninterrupted run of the writer's steps (to float32 rounding)."""
    a = make(options=saved)
    g0, _ = run(a, steps=1)
    a.save(tmp_path)
    g1, wa = run(a, steps=1)
    b = make(options=resumed)
    b.restore(tmp_path)
    own = make(options=resumed).optimizer.param_groups[0]
    for g in b.optimizer.param_groups:
        assert (g["foreach"], g["fused"]) == (own["foreach"], own["fused"])
        for p in g["params"]:
            assert b.optimizer.state[p]["step"].device == _step_device(g, p)
    before = dict(spy)
    _, wb = run(b, steps=1, replay=g1)
    impl = "fused" if resumed == FUSED else "single"
    assert spy[impl] == before[impl] + 1
    for n, x in wa[0].items():
        torch.testing.assert_close(wb[0][n], x, **F32, msg=n)


def test_step_counters_live_where_torch_puts_them():
    """``_step_device``: fused (or capturable) on the param's device, else the host (CUDA's
    foreach keeps float32 CPU scalars), the rule ``restore`` applies to a loaded checkpoint."""
    p = torch.empty(2, device="meta")
    assert _step_device({"fused": True, "capturable": False}, p) == torch.device("meta")
    assert _step_device({"fused": None, "capturable": True}, p) == torch.device("meta")
    assert _step_device({"fused": None, "capturable": False}, p) == torch.device("cpu")


# -- the planner ----------------------------------------------------------------------------------
TINY = get_preset("tiny")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planner_traces_the_fused_kernel_without_temporaries(dtype):
    """The planner's fake-tensor ``TorchTrainer`` step on tiny, one micro-batch of 1 x 32 tokens
    (foreach's peak lies in its optimizer step) with ``adamw=fused``: the same params, gradients
    and moments; the step counters on the device (4 B per tensor, in ``optimizer``, none on the
    host); foreach's AdamW temporaries (seen: the trainable params' bytes, + 812 B, as for
    Qwen3-4B; MemTracker files them as ``Optstate``) gone: fused's peak lies in the
    forward/backward, activations + temporaries at the peak drop by more than 5x (seen 14.8x
    float32, 10.7x bf16 mixed), the peak by most of the params' bytes."""
    n_tensors = len(TINY.param_shapes())
    foreach = memplan.trainer_step_memory(TINY, 1, 32, rows=1, dtype=dtype, options=FOREACH)
    fused = memplan.trainer_step_memory(TINY, 1, 32, rows=1, dtype=dtype, options=FUSED)
    auto = memplan.trainer_step_memory(TINY, 1, 32, rows=1, dtype=dtype)  # the default plans CUDA's fused
    assert (auto.adamw, auto.peak, auto.optimizer) == ("fused", fused.peak, fused.optimizer)
    assert (foreach.adamw, fused.adamw) == ("foreach", "fused")
    assert (fused.params, fused.grads, fused.fwd_bwd_peak) == (
        foreach.params,
        foreach.grads,
        foreach.fwd_bwd_peak,
    )
    assert foreach.host_scalars == 4 * n_tensors and fused.host_scalars == 0
    assert fused.optimizer == foreach.optimizer + 4 * n_tensors
    assert foreach.peak_total > foreach.fwd_bwd_peak["Total"] - foreach.host_scalars  # in the AdamW step
    assert fused.peak_total == fused.fwd_bwd_peak["Total"]  # in the forward/backward
    assert foreach.activations > 5 * fused.activations, (fused.activations, foreach.activations)
    assert foreach.activations >= foreach.params  # one float32 params' worth of foreach temporaries
    assert foreach.peak_total - fused.peak_total > 0.8 * foreach.params


def test_plan_names_the_fused_optimizer():
    req = dataclasses.replace(memplan_request(), options={"adamw": "fused"})
    m = memplan.measure(req)
    assert "AdamW fused" in m.functions["grad_step"].detail
    assert "model options adamw=fused" in m.functions["grad_step"].detail
    assert "(fused)" in m.components["optimizer"].detail
    assert memplan.options_key({"adamw": "auto"}) == memplan.options_key({"adamw": None}) == ()
    assert memplan.options_key({"adamw": "FUSED"}) == (("adamw", "fused"),)


def memplan_request():
    from mllm_rl.memplan.request import PlanRequest

    return PlanRequest(backend="torch", target="h100", model=TINY, micro_batch=2, seq_len=32, prompts=2,
                       group_size=2, param_dtype="float32", kv_tokens=1000)  # fmt: skip


# -- the option -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value, name",
    [("auto", "auto"), ("foreach", "foreach"), ("fused", "fused"), ("Fused", "fused"), (None, "auto")],
)
def test_adamw_values(value, name):
    assert adamw_name(value) == name
    assert TorchModelOptions.from_pairs({"adamw": value}).adamw == name


@pytest.mark.parametrize("value", ["adam", True, 1, "fused,foreach"])
def test_bad_adamw_is_refused_in_one_line(value):
    from mllm_rl.backends.torch import TorchBackend

    for check in (
        lambda: TorchModelOptions.from_pairs([("adamw", value)]),
        lambda: TorchBackend().check_trainer_args(None, TrainConfig(model_options=(("adamw", value),))),  # type: ignore[arg-type]
        lambda: make(options=(("adamw", value),)),
        lambda: memplan.check_request(dataclasses.replace(memplan_request(), options={"adamw": value})),
    ):
        with pytest.raises(ValueError, match="--model-option adamw=") as e:
            check()
        assert "\n" not in str(e.value) and "auto, foreach, fused" in str(e.value)


def test_memplan_cli_refuses_a_bad_adamw():
    r = run_cli("mllm_rl.memplan", "--backend", "torch", "--target", "h100", "--model", "tiny",
                "--micro-batch-size", "2", "--seq-len", "32", "--model-option", "adamw=adam")  # fmt: skip
    assert r.returncode == 2, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if "adamw" in ln]  # after the CLI's own progress line
    assert len(errors) == 1 and errors[0].startswith("error: ") and "--model-option adamw='adam'" in errors[0]
    assert "Traceback" not in r.stderr

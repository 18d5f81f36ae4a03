"""The torch memory planner (backends/torch/memplan.py) against hand counts from the model's shapes.

The trainer figures come from the real TorchTrainer step on fake tensors; each is checked
against what ``ModelConfig.param_shapes`` says it must be, the SGLang layout figures against
the formulas written out here, and the composed plan against an over-large configuration.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

from mllm_rl.backends.torch import memplan
from mllm_rl.backends.torch import sglang_calls as sc
from mllm_rl.memplan.planner import kv_room, plans, with_kv_tokens
from mllm_rl.memplan.request import PlanRequest
from mllm_rl.presets import get_preset
from tests.conftest import ROOT, run_cli

TINY = get_preset("tiny")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# AdamW fused (what adamw=auto, the default, runs on CUDA) keeps one float32 step counter per
# trainable tensor on the device: in ``optimizer``
COUNTERS = 4 * len(TINY.param_shapes())
LORA_COUNTERS = 4 * 2 * sum(name.split(".")[-2] in LINEARS for name in TINY.param_shapes())  # lora_a, lora_b


def nbytes(shapes, itemsize: int) -> int:
    return sum(math.prod(s) for s in shapes) * itemsize


def request(**kw) -> PlanRequest:
    base = dict(backend="torch", target="h100", model=TINY, micro_batch=2, seq_len=32, prompts=2, group_size=2,
                param_dtype="float32")  # fmt: skip
    return PlanRequest(**{**base, **kw})


def plan(measured, req: PlanRequest):
    """The core's composition (what ``python -m mllm_rl.memplan`` prints) for ``req.schedule``."""
    return plans(measured, req)[req.schedule]


@pytest.fixture(scope="module")
def tiny_fp32():
    return memplan.measure(request(kv_tokens=1000))


def test_trainer_components_equal_the_hand_count(tiny_fp32):
    params = nbytes(TINY.param_shapes().values(), 4)
    c = tiny_fp32.components
    assert c["trainer_params"].bytes_per_device == params
    assert c["grads"].bytes_per_device == params  # full fine-tune: every param trains
    assert c["optimizer"].bytes_per_device == 2 * params + COUNTERS  # exp_avg, exp_avg_sq (param dtype)
    assert {c[k].method for k in ("trainer_params", "grads", "optimizer")} == {"fake_tensor"}
    f = tiny_fp32.functions["grad_step"]
    assert f.method == "fake_tensor" and f.argument_bytes == 4 * params + COUNTERS
    assert f.extra_bytes > 0 and f.peak_bytes == f.argument_bytes + f.extra_bytes


def test_bf16_trains_float32_masters_by_default(tiny_fp32):
    """Mixed precision (the trainer's default) on a bf16 checkpoint: N params held as float32
    masters (4N B), float32 gradients (4N B: autograd casts them back from the bf16 compute),
    float32 AdamW moments (2 x 4N B): a float32 checkpoint's bytes. The engine holds bf16 (2N B)
    and an update has one bf16 cast of a master in flight next to its bucket."""
    n = nbytes(TINY.param_shapes().values(), 1)
    m = memplan.measure(request(param_dtype="bfloat16", kv_tokens=1000))
    c = m.components
    assert c["trainer_params"].bytes_per_device == 4 * n
    assert c["grads"].bytes_per_device == 4 * n
    assert c["optimizer"].bytes_per_device == 2 * 4 * n + COUNTERS
    for k in ("trainer_params", "grads", "optimizer"):
        assert c[k].bytes_per_device == tiny_fp32.components[k].bytes_per_device, k
    rope = TINY.max_position_embeddings * TINY.head_dim * 4
    largest = max(math.prod(s) for s in TINY.param_shapes().values())
    assert c["engine_weights"].bytes_per_device == 2 * n + rope
    assert c["staging"].bytes_per_device == 2 * n + 2 * largest  # one bucket + the cast being placed
    assert "float32 masters (computing in bfloat16)" in c["trainer_params"].detail
    assert not any("optimizer_dtype" in note for note in m.notes)  # float32 moments: what was asked


def test_bf16_kl_reference_is_held_in_the_compute_dtype():
    n = nbytes(TINY.param_shapes().values(), 1)
    s = memplan.trainer_step_memory(TINY, 2, 32, rows=4, dtype="bfloat16", kl=True)
    assert (s.params, s.ref_params, s.grads, s.optimizer) == (4 * n, 2 * n, 4 * n, 2 * 4 * n + COUNTERS)
    assert (s.master_dtype, s.compute_dtype) == ("float32", "bfloat16")


def test_bf16_lora_base_stays_bf16_and_adapters_are_float32():
    r = 4
    n = nbytes(TINY.param_shapes().values(), 1)
    adapters = sum(r * (shape[0] + shape[1]) for name, shape in TINY.param_shapes().items()
                   if name.split(".")[-2] in LINEARS)  # fmt: skip
    s = memplan.trainer_step_memory(TINY, 2, 32, rows=4, dtype="bfloat16", lora_rank=r)
    assert (s.params, s.grads, s.optimizer) == (
        2 * n + 4 * adapters,
        4 * adapters,
        2 * 4 * adapters + LORA_COUNTERS,
    )


def test_bf16_pure_precision_halves_the_state():
    """``precision="pure"``: params, gradients and AdamW moments in bf16, N x (2 + 2 + 2 x 2) B."""
    n = nbytes(TINY.param_shapes().values(), 1)
    s = memplan.trainer_step_memory(TINY, 2, 32, rows=4, dtype="bfloat16", precision="pure")
    assert (s.params, s.grads, s.optimizer) == (2 * n, 2 * n, 2 * 2 * n + COUNTERS)
    assert (s.master_dtype, s.compute_dtype) == ("bfloat16", "bfloat16")


def test_engine_layout_figures_equal_the_hand_count(tiny_fp32):
    c = tiny_fp32.components
    params = nbytes(TINY.param_shapes().values(), 4)
    rope = TINY.max_position_embeddings * TINY.head_dim * 4  # fp32 cos/sin cache; vocab 384 needs no padding
    assert c["engine_weights"].bytes_per_device == params + rope
    assert c["staging"].bytes_per_device == params  # every tiny tensor fits one 64 MiB bucket
    cell = TINY.num_hidden_layers * 2 * TINY.num_key_value_heads * TINY.head_dim * 4
    req_to_token = (min(sc.MAX_RUNNING_REQUESTS, 1000 // 2) + 1) * (32 + 4) * 4
    assert c["kv_pool"].bytes_per_device == (1000 + 1) * cell + req_to_token
    assert {c[k].method for k in ("engine_weights", "staging", "kv_pool")} == {"layout"}


def test_cuda_plans_hold_two_cublas_workspaces_in_every_step_phase(tiny_fp32, monkeypatch):
    """torch's cuBLAS workspaces: 32 MiB each on Hopper (an H200 run kept two such blocks after
    release_rollout), ``CUBLAS_WORKSPACE_CONFIG`` when set; in every step phase, never in setup;
    none on CPU."""
    assert memplan.blas_workspace_bytes(9, None) == 32 * 2**20
    assert memplan.blas_workspace_bytes(8, None) == 4096 * 1024 * 2 + 16 * 1024 * 8  # :4096:2:16:8
    assert memplan.blas_workspace_bytes(9, ":4096:2:16:8") == (4096 * 2 + 16 * 8) * 1024
    assert memplan.blas_workspace_bytes(9, ":0:0") == 0
    assert memplan.blas_workspace_bytes(9, "junk") == 32 * 2**20  # torch warns and takes its default
    ws = tiny_fp32.components["blas_workspaces"]
    assert ws.bytes_per_device == 2 * 32 * 2**20 and ws.method == "layout"
    rows = plan(tiny_fp32, request(kv_tokens=1000)).phases
    assert all(("blas_workspaces" in p.resident) != p.phase.startswith("setup:") for p in rows)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:1")
    assert memplan.blas_workspaces(tiny_fp32.target).bytes_per_device == 2 * 4096 * 1024
    cpu = memplan.measure(request(target="cpu", kv_tokens=1000))
    assert "blas_workspaces" not in cpu.components


def test_staging_is_the_largest_update_bucket():
    q = get_preset("qwen3-0.6b")
    embed = 151936 * 1024 * 2  # 297 MiB: over the chunk, a bucket of its own
    assert memplan.staging_bytes(q, 2) == embed
    assert memplan.staging_bytes(q, 2, chunk=2**40) == nbytes(q.param_shapes().values(), 2)  # one bucket
    assert memplan.staging_bytes(q, 2, lora=True) == 2 * embed  # + one merged LoRA weight in flight
    assert memplan.staging_bytes(q, 2, cast=True) == 2 * embed  # + one bf16 cast of a float32 master


def test_sglang_pool_rule():
    cell = 36 * 2 * 8 * 128 * 2  # qwen3-4b bf16
    free, weights = 80 * 2**30, 8 * 2**30
    assert memplan.sglang_pool_tokens(free, weights, cell, 0.6) == (int(free * 0.6) - weights) // cell
    assert memplan.sglang_pool_tokens(free, free, cell, 0.6) == 0  # weights over the static share: no pool


def test_lora_trains_only_the_adapters():
    r = 4
    m = memplan.measure(request(lora_rank=r, kv_tokens=1000))
    base = nbytes(TINY.param_shapes().values(), 4)
    adapters = sum(r * (shape[0] + shape[1]) for name, shape in TINY.param_shapes().items()
                   if name.split(".")[-2] in LINEARS) * 4  # fmt: skip
    c = m.components
    assert c["grads"].bytes_per_device == adapters
    assert c["optimizer"].bytes_per_device == 2 * adapters + LORA_COUNTERS
    assert c["trainer_params"].bytes_per_device == base + adapters


def test_kl_full_finetune_holds_reference_params(tiny_fp32):
    m = memplan.measure(request(kl=True, kv_tokens=1000))
    params = nbytes(TINY.param_shapes().values(), 4)
    assert m.components["ref_params"].bytes_per_device == params
    assert m.components["trainer_params"].bytes_per_device == params
    assert m.functions["grad_step"].argument_bytes == 5 * params + COUNTERS
    # the reference forward adds to the step's peak: it cannot be lower than without KL
    assert m.functions["grad_step"].peak_bytes >= tiny_fp32.functions["grad_step"].peak_bytes + params


def test_activations_grow_linearly_with_batch():
    """From 2 rows on the backward's activations set the peak (at 1 row AdamW's foreach
    temporaries, one params-sized set, are larger) and grow by the same bytes per row."""
    acts = [memplan.trainer_step_memory(TINY, b, 64, rows=b, dtype="float32", steps=1).activations
            for b in (2, 4, 8)]  # fmt: skip
    assert acts[0] < acts[1] < acts[2]
    assert acts[2] - acts[1] == pytest.approx(2 * (acts[1] - acts[0]), rel=0.01)
    assert acts[0] > nbytes(TINY.param_shapes().values(), 4)  # past the optimizer's temporaries


def test_over_large_step_reports_phase_and_component():
    # activations grow linearly with the tokens (SDPA, chunked head): the tiny model made 4 layers
    # deep with a 32768-wide MLP keeps ~2.2 MiB a token, so 2 x 20480 tokens (~93 GiB) cross the
    # 71.2 GiB budget (few layers and few head chunks to trace: seconds)
    big = dataclasses.replace(TINY, num_hidden_layers=4, intermediate_size=32768)
    req = request(model=big, micro_batch=2, seq_len=20480, prompts=1, group_size=2, kv_tokens=1000)
    p = plan(memplan.measure(req), req)
    assert not p.fits
    assert p.first_overflow() == ("train_step", "temp:grad_step")


def test_over_large_kv_pool_reports_phase_and_component():
    req = request(mem_fraction_static=0.95, kv_tokens=10**9)
    m = memplan.measure(req)
    p = plan(m, req)
    assert p.first_overflow() == ("setup:release_rollout", "kv_pool")  # the dummy engine at start
    assert m.components["kv_pool"].bytes_per_device > p.budget  # SGLang's rule at 0.95 caps it above 90%
    assert any("caps the pool" in n for n in m.notes)


def test_kv_pool_follows_sglangs_rule_and_reports_what_the_core_needs():
    req = request()
    m = memplan.measure(req)
    cell = TINY.num_hidden_layers * 2 * TINY.num_key_value_heads * TINY.head_dim * 4
    weights = m.components["engine_weights"].bytes_per_device
    tokens = memplan.sglang_pool_tokens(m.target.hbm_bytes, weights, cell, sc.MEM_FRACTION_STATIC)
    assert m.info["kv_tokens"] == tokens and m.info["kv_cell_bytes"] == cell
    assert m.info["kv_pad_tokens"] == 1 and m.info["engine_free_bytes"] == m.target.hbm_bytes
    assert m.info["mem_fraction_static"] == sc.MEM_FRACTION_STATIC
    # asked for a pool: the mem_fraction_static SGLang needs for it (its rule solved backwards)
    asked = memplan.measure(request(kv_tokens=tokens))
    assert asked.info["mem_fraction_static"] == pytest.approx(sc.MEM_FRACTION_STATIC, abs=0.001)
    # the core's --fit kv: the largest pool every phase holding it leaves room for, with the margin
    fitted, phase = kv_room(plan(m, req), m)
    fm = with_kv_tokens(m, fitted)
    assert plan(fm, req).fits and not plan(with_kv_tokens(m, fitted + 1), req).fits
    assert phase.endswith("release_rollout") or phase in ("rollout", "resume_kv")


def test_no_room_for_a_pool_is_refused_before_tracing():
    with pytest.raises(ValueError, match="no room for a KV pool"):
        memplan.measure(request(mem_fraction_static=1e-6))


def test_planner_imports_no_torch():
    code = "import sys, mllm_rl.backends.torch.memplan as m; m.targets(); print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.stdout.strip() == "False", r.stderr[-2000:]


def test_cli_plans_with_the_torch_backend(tmp_path):
    args = ["--backend", "torch", "--model", "tiny", "--micro-batch", "2", "--seq-len", "32",
            "--prompts-per-step", "2", "--group-size", "2"]  # fmt: skip
    r = run_cli("mllm_rl.memplan", *args, "--target", "h100", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "fake_tensor" in r.stdout and "layout" in r.stdout and "multi_stage: fits" in r.stdout
    doc = json.loads((tmp_path / "plan.json").read_text())
    assert doc["kind"] == "predicted"
    bad = run_cli("mllm_rl.memplan", *args, "--target", "v4-8")
    assert bad.returncode == 2 and "--target 'v4-8'" in bad.stderr


@pytest.mark.parametrize(
    "kw, field",
    [({"tp": 2}, "PlanRequest.tp"), ({"target": "h100x16"}, "PlanRequest.target"),
     ({"target": "v4-8"}, "PlanRequest.target"), ({"backend": "jax"}, "PlanRequest.backend"),
     ({"param_dtype": "int8"}, "PlanRequest.param_dtype"), ({"fsdp": 2}, "--fsdp 2"),
     ({"target": "h100x4", "fsdp": 3}, "--fsdp 3"), ({"target": "h100x4", "engine": "sglang"}, "PlanRequest.engine"),

     ({"trainer_tp": 2}, "PlanRequest.trainer_tp"), ({"options": {"scan_layers": True}}, "PlanRequest.options"),
     ({"options": {"remat": "dots"}}, "PlanRequest.options")],
)  # fmt: skip
def test_refusals_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        memplan.check_request(request(**kw))


def test_remat_option_plans_the_checkpointed_step(tiny_fp32):
    """``--model-option remat=true`` (JAX's ``remat=block`` too) reaches the traced trainer: the
    same state, a lower ``grad_step`` peak, the option named in its detail."""
    m = memplan.measure(request(kv_tokens=1000, seq_len=512, options={"remat": "block"}))
    base = memplan.measure(request(kv_tokens=1000, seq_len=512))
    for k in ("trainer_params", "grads", "optimizer"):
        assert m.components[k].bytes_per_device == tiny_fp32.components[k].bytes_per_device, k
    f, f0 = m.functions["grad_step"], base.functions["grad_step"]
    assert f.peak_bytes < f0.peak_bytes and "model options remat=True" in f.detail
    assert "model options" not in f0.detail
    assert (
        memplan.options_key({"remat": "block"}) == memplan.options_key({"remat": True}) == (("remat", True),)
    )
    assert memplan.options_key({"remat": False}) == ()


@pytest.mark.parametrize("kw", [{"kl": True}, {"lora_rank": 4, "world": 2}], ids=["full-kl", "lora-fsdp2"])
def test_a_second_step_plans_the_same_bytes_as_the_first(kw):
    """The planner traces one train step (``STEPS``): the trainer makes its AdamW state when built,
    so a second step holds the same tensors. Were the state made lazily by the first step, the
    second step's figures would differ from the first's here."""
    assert memplan.STEPS == 1
    args = (TINY, 2, 32, 4, "bfloat16")
    one, two = (memplan.trainer_step_memory(*args, steps=n, **kw) for n in (1, 2))
    same = lambda s: dataclasses.replace(s, seconds=0.0)  # noqa: E731
    assert one.optimizer > 0 and same(one) == same(two)


def test_targets_from_the_card_spec():
    """The same device memory the JAX planner plans against: the XLA GPU target configs."""
    h100, h200 = memplan.parse_target("h100"), memplan.parse_target("h200x1")
    assert h100.hbm_bytes == 84942979072 and h200.hbm_bytes == memplan.card_memory("h200.txtpb")
    assert "h100_sxm.txtpb" in h100.source and h100.num_devices == 1
    assert set(memplan.targets()) == {
        *(f"{card}{n}" for card in ("h100", "h200") for n in ("", "x1", "x2", "x4", "x8")),
        "cpu",
        "cuda",
    }  # cpu, cuda: this machine
    node = memplan.parse_target("h100x8")
    assert node.num_devices == 8 and node.num_hosts == 1 and node.hbm_bytes == h100.hbm_bytes


def test_a_run_of_n_processes_plans_itself_for_n_local_devices():
    """What a run plans itself against (``target_for_runtime``): one process, this device; N
    processes, ``cpuxN`` / ``cudaxN`` (N devices, one per process: FSDP2 over them); on CPU the N
    share the host's budget, each planned for its 1/N. A process of a real process group plans in a
    fresh one (``plans_in_process``): torch's fake process group cannot open there."""
    t = memplan.target_for_runtime
    assert t({"platform": "cpu"}) == "cpu" and t({"platform": "cpu", "process_count": 2}) == "cpux2"
    assert t({"platform": "cuda", "process_count": 4}) == "cudax4" and t({"platform": "tpu"}) is None
    assert t({"platform": "cpu", "process_count": memplan.MAX_CARDS + 1}) is None
    one, two = memplan.parse_target("cpu"), memplan.parse_target("cpux2")
    assert (two.platform, two.num_devices, two.num_hosts, two.devices_per_host) == ("cpu", 2, 1, 2)
    # the budget is half of what psutil says is available at each call: the two calls may differ a bit
    assert (
        two.hbm_bytes == pytest.approx(one.hbm_bytes / 2, rel=0.1) and "shared by 2 processes" in two.source
    )
    with pytest.raises(ValueError, match="1 to 8 processes"):
        memplan.parse_target("cpux9")
    assert memplan.plans_in_process("cpux2")  # no process group in this test process
    m = memplan.measure(request(kv_tokens=1000, target="cpux2", prompts=8))
    assert any("FSDP2 over 2 devices" in n for n in m.notes)


def test_a_node_plans_one_device_of_the_fsdp2_sharded_trainer(tiny_fp32):
    """``h100x4``: the trainer sharded with FSDP2 over 4 cards, traced as rank 0 of torch's fake
    process group: params, gradients and AdamW moments are a quarter of one card's (each tensor's
    dim 0 split in 4: tiny's dims all divide), the step counters whole (one per tensor on every
    rank), the step's peak lower; an embedded engine per card (auto: SGLang across processes is not
    supported), the same as one card's. ``fsdp=1``: every card holds the whole trainer. With a KL
    term the reference is held as shards too."""
    m = memplan.measure(request(kv_tokens=1000, target="h100x4", prompts=8))
    whole = {k: tiny_fp32.components[k].bytes_per_device for k in ("trainer_params", "grads", "optimizer")}
    c = {k: m.components[k].bytes_per_device for k in whole}
    assert c["trainer_params"] * 4 == whole["trainer_params"] and c["grads"] * 4 == whole["grads"]
    assert (c["optimizer"] - COUNTERS) * 4 == whole["optimizer"] - COUNTERS
    assert m.functions["grad_step"].peak_bytes < tiny_fp32.functions["grad_step"].peak_bytes
    assert "on each of 4 devices" in m.functions["grad_step"].detail
    assert any("FSDP2 over 4 devices" in n for n in m.notes)
    assert m.components["engine_weights"].detail.startswith("embedded engine")
    r = memplan.measure(request(kv_tokens=1000, target="h100x4", fsdp=1))
    assert {k: r.components[k].bytes_per_device for k in whole} == whole
    # a full fine-tune's KL reference: this card's shards of the initial params (here float32, the
    # checkpoint's dtype), copied into the params' shards for its forward: the params stay params
    k = memplan.measure(request(kv_tokens=1000, target="h100x4", prompts=8, kl=True))
    assert k.components["ref_params"].bytes_per_device == c["trainer_params"]
    assert k.components["trainer_params"].bytes_per_device == c["trainer_params"]


@pytest.mark.slow
def test_qwen3_plan_allocates_nothing():
    """A Qwen3-0.6B plan (bf16 checkpoint, float32 masters: 2.2 GiB params, 4.5 GiB AdamW state
    if real) in a fresh process: its peak host RSS stays far below what one real copy of the
    params would take."""
    code = (
        "import json, resource\n"
        "from mllm_rl.backends.torch.memplan import measure\n"
        "from mllm_rl.memplan.request import PlanRequest\n"
        "from mllm_rl.presets import get_preset\n"
        "m = measure(PlanRequest('torch', 'h100', get_preset('qwen3-0.6b'), micro_batch=1, seq_len=256, prompts=1,"
        " group_size=2))\n"
        "print(json.dumps({'rss': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,"
        " 'params': m.components['trainer_params'].bytes_per_device}))\n"
    )  # fmt: skip
    env = {**os.environ, "MLLM_RL_PLAN_CACHE": ""}  # traced here, not read from an earlier trace
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["params"] == nbytes(get_preset("qwen3-0.6b").param_shapes().values(), 4)  # float32 masters
    assert out["rss"] < 0.75 * out["params"], out


def test_step_memory_categories_add_up():
    s = memplan.trainer_step_memory(TINY, 2, 32, rows=4, dtype="float32", options=(("adamw", "foreach"),))
    assert s.micro_batches == 2
    peak = dataclasses.asdict(s)["peak"]
    assert s.peak_total == peak["Total"] - s.host_scalars
    assert s.peak_total == sum(v for k, v in peak.items() if k != "Total") - s.host_scalars
    assert s.host_scalars == COUNTERS  # foreach on CUDA: one float32 step counter per tensor, on the host


def test_bench_plan_only_prints_both_schedules(tmp_path):
    out = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "mllm_rl.bench", "plan", "vs-run", "--backend", "torch",
                        "--plan-only", "--preset", "tiny", "--micro-batch", "2", "--seq-len", "32", "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "trainer_params [fake_tensor]" in r.stdout and "kv_pool [layout]" in r.stdout
    data = json.loads(out.read_text())
    assert [p["schedule"] for p in data["plans"]] == ["multi_stage", "naive"]
    assert all(p["fits"] for p in data["plans"]) and data["kind"] == "predicted"
    bad = subprocess.run([sys.executable, "-m", "mllm_rl.bench", "plan", "vs-run", "--backend", "torch",
                          "--plan-only", "--preset", "tiny", "--target", "h100x16"], capture_output=True, text=True, cwd=ROOT, timeout=600)  # fmt: skip
    assert bad.returncode == 2 and "PlanRequest.target" in bad.stderr


def test_bench_plan_vs_cuda_plans_reuses_and_refuses(tmp_path):
    """``python -m mllm_rl.bench plan vs-cuda``: ``--plan-only`` writes the planner's step (the figures of
    ``trainer_step_memory`` for the same case); ``--plan-json`` of another case is refused (exit 2)
    before anything runs; without CUDA the measured side is one line, exit 1 (with CUDA it runs:
    the figures in docs/PLAN.md)."""
    script = [sys.executable, "-m", "mllm_rl.bench", "plan", "vs-cuda", "--preset", "tiny", "--micro-batch", "2",
              "--seq-len", "64", "--option", "remat=true"]  # fmt: skip
    plan = tmp_path / "plan.json"
    r = subprocess.run([*script, "--plan-only", "--json", str(plan)], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(plan.read_text())["predicted"]
    want = memplan.trainer_step_memory(TINY, 2, 64, rows=2, dtype="bfloat16", options=(("remat", True),))
    assert (got["peak_bytes"], got["state_bytes"], got["adamw"]) == (
        want.peak_total,
        want.params + want.optimizer,
        "fused",
    )
    other = subprocess.run([*script[:-2], "--plan-json", str(plan)], capture_output=True, text=True, cwd=ROOT,
                           timeout=600)  # fmt: skip
    assert other.returncode == 2 and "--plan-json" in other.stderr and "planned for" in other.stderr
    import torch

    if torch.cuda.is_available():
        return
    r = subprocess.run(
        [*script, "--plan-json", str(plan)], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert r.returncode == 1 and "no CUDA device" in r.stderr


@pytest.mark.slow
def test_bench_cross_check_tiny(tmp_path):
    """The plan's params / grads / optimizer within 1% of a live CPU run's (exit 1 otherwise)."""
    out = tmp_path / "x.json"
    r = subprocess.run([sys.executable, "-m", "mllm_rl.bench", "plan", "vs-run", "--backend", "torch", "--preset", "tiny",
                        "--run-dir", str(tmp_path / "run"), "--json", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=1200)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {row["quantity"] for row in data["rows"]} == {"params", "optimizer", "grads"}
    assert all(t["pass"] for t in data["targets"].values())

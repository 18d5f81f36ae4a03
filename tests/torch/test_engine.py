"""Embedded torch engine details the contract does not pin down: sampling, batching, bad input."""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import pytest
import torch

import mllm_rl.backends.torch.engine as engine_mod
from mllm_rl.backends.torch.engine import (
    EmbeddedEngine,
    Placed,
    copy_with_sums,
    sample,
    tensor_sums,
    uniforms,
)
from mllm_rl.backends.torch.model import greedy_decode, load_qwen3
from mllm_rl.checkpoint import ModelDir, make_checkpoint
from mllm_rl.engine import SamplingParams, WeightExport, compare_fingerprints
from mllm_rl.engine_state import ManagedEngine
from mllm_rl.presets import get_preset

PROMPTS = [[51, 71, 68, 220, 66, 64, 79], [160, 121, 254, 162], [72, 83, 64, 75, 1, 2, 3, 4, 5, 6]]
GREEDY = SamplingParams(max_new_tokens=8)


def swapped(ckpt, **kw) -> ManagedEngine:
    model = ModelDir.open(ckpt)
    eng = ManagedEngine(EmbeddedEngine(model, device="cpu", **kw))
    eng.update_weights(WeightExport(list(model.tensors), model.iter_tensors(), full=True))
    return eng


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return swapped(tiny_ckpt)


@pytest.mark.slow
def test_greedy_equals_our_reference_decoder(engine, tiny_ckpt):
    ref = load_qwen3(ModelDir.open(tiny_ckpt))
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, GREEDY), strict=True):
        toks, lps = greedy_decode(ref, prompt, 8)
        assert out.token_ids == toks and out.finish_reason == "length"
        assert max(abs(a - b) for a, b in zip(out.logprobs, lps, strict=True)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{"max_total_tokens": 40, "context_length": 32}, {"max_running_requests": 1}])
def test_sub_batches_give_the_same_tokens(engine, tiny_ckpt, kw):
    small = swapped(tiny_ckpt, **kw)
    assert [o.token_ids for o in small.generate(PROMPTS, GREEDY)] == [
        o.token_ids for o in engine.generate(PROMPTS, GREEDY)
    ]


@pytest.mark.slow
def test_context_length_caps_new_tokens(tiny_ckpt):
    eng = swapped(tiny_ckpt, max_total_tokens=64, context_length=12)
    outs = eng.generate(PROMPTS, SamplingParams(max_new_tokens=50))
    assert [len(o.token_ids) for o in outs] == [12 - len(p) for p in PROMPTS]
    assert all(o.finish_reason == "length" for o in outs)


@pytest.mark.slow
@pytest.mark.parametrize(
    "prompts,match",
    [([[]], "prompt 0: empty"), ([[1] * 600], "--context-length 512"), ([[5, 384]], r"outside \[0, 384\)")],
)
def test_bad_prompts_are_refused_and_leave_the_engine_usable(engine, prompts, match):
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, GREEDY)
    assert engine.state()["in_flight"] == 0
    assert len(engine.generate(PROMPTS[:1], GREEDY)[0].token_ids) == 8


@pytest.mark.slow
def test_update_with_a_wrong_shape_names_the_tensor(tiny_ckpt):
    eng = swapped(tiny_ckpt)
    fp = eng.weights_fingerprint()
    bad = WeightExport.of([("model.norm.weight", torch.zeros(7))], full=False)
    with pytest.raises(ValueError, match=r"model.norm.weight: shape \(7,\) does not match engine \(128,\)"):
        eng.update_weights(bad)
    assert eng.weights_fingerprint() == fp


@pytest.mark.slow
def test_updates_from_torch_tensors_and_placed_tensors(tiny_ckpt, engine):
    """What a torch trainer exports (tensors, any dtype) and the naive baseline's Placed tensors."""
    ref = load_qwen3(ModelDir.open(tiny_ckpt))
    want = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    eng = ManagedEngine(EmbeddedEngine(ModelDir.open(tiny_ckpt), device="cpu"))
    eng.update_weights(
        WeightExport.of([(n, p.detach().double()) for n, p in ref.named_parameters()], full=True)
    )
    assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == want
    eng2 = ManagedEngine(EmbeddedEngine(ModelDir.open(tiny_ckpt), device="cpu"))
    placed = [(n, Placed(eng2.engine.place(n, p.detach()))) for n, p in ref.named_parameters()]
    eng2.update_weights(WeightExport.of(placed, full=True))
    assert [o.token_ids for o in eng2.generate(PROMPTS, GREEDY)] == want


@pytest.mark.slow
def test_chunked_update_equals_whole_update(tiny_ckpt):
    whole = swapped(tiny_ckpt, chunk_bytes=0)
    chunked = swapped(tiny_ckpt, chunk_bytes=10_000)  # every matrix in ~20 slices
    assert chunked.weights_fingerprint() == whole.weights_fingerprint()


def test_fingerprint_sums():
    x = torch.arange(3 * 2**20 + 5, dtype=torch.float32) / 2**20  # more than one 2**20 slice
    s, q = tensor_sums(x)
    assert math.isclose(float(s), float(x.double().sum()), rel_tol=1e-6)
    assert math.isclose(float(q), float((x.double() ** 2).sum()), rel_tol=1e-6)


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_copy_with_sums_writes_in_pieces_and_sums_what_it_wrote(monkeypatch, src_dtype):
    monkeypatch.setattr(engine_mod, "_FP_CHUNK", 1000)  # 3737 elements: four pieces
    src = torch.randn(37, 101, generator=torch.Generator().manual_seed(0)).to(src_dtype)
    dst = torch.zeros(37, 101, dtype=torch.bfloat16)
    got = copy_with_sums(dst, src)
    assert torch.equal(dst, src.to(torch.bfloat16))
    want = tensor_sums(dst)
    assert torch.allclose(got, want, rtol=1e-9)
    untouched = torch.zeros_like(dst)  # write=False (the swap_noop fault): the sums of src, nothing written
    assert (
        torch.allclose(copy_with_sums(untouched, src, write=False), want, rtol=1e-9) and not untouched.any()
    )
    strided = torch.zeros(101, 37, dtype=torch.bfloat16).T  # not contiguous: copied whole, then summed
    assert torch.allclose(copy_with_sums(strided, src), want, rtol=1e-9) and torch.equal(strided, dst)


def test_an_update_is_fingerprinted_from_the_engines_tensors_and_not_read_back(tiny_ckpt):
    """Each piece is summed from the engine's own tensor as written: every tensor is proven
    installed, so the update's check reads nothing back; a fingerprint of the weights read
    afterwards agrees."""
    ref = load_qwen3(ModelDir.open(tiny_ckpt))
    eng = ManagedEngine(EmbeddedEngine(ModelDir.open(tiny_ckpt), device="cpu", chunk_bytes=10_000))
    stats = eng.update_weights(
        WeightExport.of([(n, p.detach()) for n, p in ref.named_parameters()], full=True)
    )
    assert stats.read_back == 0 and stats.installed == frozenset(stats.fingerprint)
    assert compare_fingerprints(stats.fingerprint, eng.weights_fingerprint()) == []


def test_sampling_top_p_keeps_the_nucleus_and_reports_tempered_logprobs():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    g = [torch.Generator().manual_seed(i) for i in range(2000)]  # one per request (row)
    tok, lp = sample(logits, SamplingParams(temperature=1.0, top_p=0.7), uniforms(g, 1)[:, 0])
    assert set(tok.tolist()) == {0, 1}  # 0.5 + 0.3 >= 0.7: token 2 and 3 are cut
    frac0 = (tok == 0).float().mean().item()
    assert abs(frac0 - 0.5 / 0.8) < 0.05  # renormalised over the nucleus
    assert torch.allclose(lp, torch.log(torch.tensor([0.5, 0.3]))[tok], atol=1e-6)  # before truncation
    tok, lp = sample(logits[:1], SamplingParams(temperature=0.5), uniforms(g[:1], 1)[:, 0])
    assert torch.allclose(lp, torch.log_softmax(logits[:1] / 0.5, -1)[0, tok])
    tok, _ = sample(logits[:5], SamplingParams(temperature=1.0, top_p=0.01), uniforms(g[:5], 1)[:, 0])
    assert tok.tolist() == [0] * 5  # the top token is always kept


def test_sampling_at_temperature_follows_the_tempered_distribution_row_by_row():
    """Temperature 0.7 over 6 tokens, two of them impossible (-inf): 20,000 requests' draws
    follow softmax(logits / 0.7) (each frequency within 4 standard errors), an impossible token is
    never drawn, and a request's token depends only on its own generator (the same draw alone, in
    a batch, or with its rows permuted)."""
    n = 20_000
    row = torch.tensor([2.0, 1.0, float("-inf"), 0.0, -1.0, float("-inf")])
    want = torch.softmax(row / 0.7, -1)
    logits = row.repeat(n, 1)
    seeds = list(range(n))
    draw = lambda seeds: uniforms([torch.Generator().manual_seed(x) for x in seeds], 1)[:, 0]  # noqa: E731
    tok, lp = sample(logits, SamplingParams(temperature=0.7), draw(seeds))
    counts = torch.bincount(tok, minlength=6).double() / n
    assert counts[2] == counts[5] == 0
    se = (want * (1 - want) / n).sqrt()
    assert ((counts - want).abs() <= 4 * se + 1e-12).all(), (counts, want)
    assert torch.allclose(lp, torch.log(want)[tok], atol=1e-6)
    # row independence: request 7 alone, and the first 50 requests reversed
    alone, _ = sample(logits[:1], SamplingParams(temperature=0.7), draw([7]))
    assert alone.item() == tok[7].item()
    rev, _ = sample(logits[:50], SamplingParams(temperature=0.7), draw(seeds[:50][::-1]))
    assert rev.flip(0).tolist() == tok[:50].tolist()


@pytest.mark.slow
def test_unseeded_sampling_follows_the_engine_seed(tiny_ckpt):
    s = SamplingParams(max_new_tokens=16, temperature=1.0)
    a, b, c = swapped(tiny_ckpt, seed=7), swapped(tiny_ckpt, seed=7), swapped(tiny_ckpt, seed=8)
    first = [o.token_ids for o in a.generate(PROMPTS, s)]
    assert first == [o.token_ids for o in b.generate(PROMPTS, s)]
    assert first != [o.token_ids for o in c.generate(PROMPTS, s)], "the engine seed has no effect"
    greedy = dataclasses.replace(s, temperature=0.0)  # same length: the tokens must differ
    assert first != [o.token_ids for o in a.generate(PROMPTS, greedy)], "sampling returned the greedy tokens"
    again = [o.token_ids for o in a.generate(PROMPTS, s)]  # the engine's generator moved on
    assert again != first and again == [o.token_ids for o in b.generate(PROMPTS, s)]


@pytest.mark.slow
def test_seeded_sampling_ignores_the_engine_seed(tiny_ckpt):
    s = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1234)
    a, b = swapped(tiny_ckpt, seed=7), swapped(tiny_ckpt, seed=8)
    first = [o.token_ids for o in a.generate(PROMPTS, s)]
    assert (
        first
        == [o.token_ids for o in a.generate(PROMPTS, s)]
        == [o.token_ids for o in b.generate(PROMPTS, s)]
    )
    other = dataclasses.replace(s, seed=99)
    assert first != [o.token_ids for o in a.generate(PROMPTS, other)], "the request seed has no effect"
    greedy = dataclasses.replace(s, temperature=0.0)
    assert first != [o.token_ids for o in a.generate(PROMPTS, greedy)], "sampling returned the greedy tokens"


@pytest.mark.slow
def test_pause_from_another_thread_returns_promptly(tiny_ckpt, monkeypatch):
    eng = swapped(tiny_ckpt)
    forward = eng.engine.model.forward_cached

    def slow_forward(*args, **kwargs):  # 480 decode steps last >= 0.96 s on any host: the pause lands mid-way
        time.sleep(0.002)
        return forward(*args, **kwargs)

    monkeypatch.setattr(eng.engine.model, "forward_cached", slow_forward)
    out = {}
    th = threading.Thread(
        target=lambda: out.update(r=eng.engine.generate(PROMPTS, SamplingParams(max_new_tokens=480)))
    )
    th.start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    eng.engine.pause_generation()
    th.join(timeout=10)
    assert not th.is_alive() and time.perf_counter() - t0 < 2.0
    assert all(o.finish_reason in ("abort", "stop") for o in out["r"]) and any(o.token_ids for o in out["r"])
    assert eng.engine.generate(PROMPTS[:1], GREEDY)[0].finish_reason == "abort"  # still paused: nothing runs
    eng.engine.continue_generation()
    assert eng.engine.generate(PROMPTS[:1], GREEDY)[0].finish_reason == "length"


@pytest.mark.slow
def test_tied_and_bf16_checkpoints_swap_and_generate(tmp_path):
    tied = dataclasses.replace(get_preset("tiny"), name="tiny-tied", tie_word_embeddings=True)
    for cfg, dtype in ((tied, "float32"), (get_preset("tiny"), "bfloat16")):
        ckpt = make_checkpoint(cfg, tmp_path / f"{cfg.name}-{dtype}", dtype=dtype, show_progress=False)
        eng = swapped(ckpt)
        assert sorted(eng.weight_names()) == sorted(ModelDir.open(ckpt).tensors)
        assert all(p.dtype == {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
                   for p in eng.engine.params.values())  # fmt: skip
        ref = load_qwen3(ModelDir.open(ckpt))
        toks, _ = greedy_decode(ref, PROMPTS[0], 4)
        assert eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4))[0].token_ids == toks


@pytest.mark.slow
def test_a_request_samples_the_same_in_any_sub_batch(tiny_ckpt):
    """Each request draws from its own generator seeded by its index in the whole batch: the same
    requests generated at once, one at a time (each with its ``request_offset``) or in sub-batches
    of another ``max_running_requests`` give the same completions; another batch seed does not."""
    eng = EmbeddedEngine(ModelDir.open(tiny_ckpt), device="cpu", max_total_tokens=2048, context_length=64)
    prompts = [[3 + i, 5, 7] for i in range(6)]
    s = SamplingParams(max_new_tokens=8, temperature=1.0, seed=11)
    whole = [o.token_ids for o in eng.generate(prompts, s)]
    one_by_one = [eng.generate([p], dataclasses.replace(s, request_offset=i))[0].token_ids
                  for i, p in enumerate(prompts)]  # fmt: skip
    assert one_by_one == whole
    small = EmbeddedEngine(ModelDir.open(tiny_ckpt), device="cpu", max_total_tokens=2048, context_length=64,
                           max_running_requests=2)  # fmt: skip
    assert [o.token_ids for o in small.generate(prompts, s)] == whole
    assert [o.token_ids for o in eng.generate(prompts, dataclasses.replace(s, seed=12))] != whole


@pytest.mark.slow
def test_a_decode_step_dispatches_fewer_ops_than_transformers_generate(tmp_path):
    """On a GPU a small model's decode step is bound by kernel launches: the embedded engine's step
    (rotary tables once per step, q and k normed and rotated as one tensor) must dispatch fewer
    ops than HF ``generate``'s on the same bf16 checkpoint of 8 layers (``bench engine``'s count); HF's
    16-bit CPU products there run through ``cpu_half.linear``, as ours."""
    from mllm_rl.bench.engine import HFGenerate, ops_per_step

    cfg = dataclasses.replace(get_preset("tiny"), num_hidden_layers=8)
    make_checkpoint(cfg, tmp_path, dtype="bfloat16")
    ids = [[40 + (i * 7 + j) % 80 for j in range(16)] for i in range(4)]
    ours = swapped(tmp_path, max_total_tokens=4 * 64, context_length=64)
    embedded = ops_per_step(lambda p, n: ours.generate(p, SamplingParams(max_new_tokens=n)), ids)
    hf = HFGenerate(ModelDir.open(tmp_path), "cpu")
    reference = ops_per_step(hf, ids)
    assert embedded < 0.9 * reference, (embedded, reference)
    # the bench's HF baseline runs its 16-bit CPU products as ours do (cpu_half.linear): same GEMM
    x = torch.randn(16, cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    assert type(hf.model.lm_head(x).grad_fn).__name__ == "_CpuHalfLinearBackward"
    assert embedded > 8 * 7  # at least the 7 projections of every layer: the count saw the model


@pytest.mark.slow
def test_a_sampled_generate_draws_its_uniforms_before_the_decode_loop(engine):
    """The uniforms come from CPU generators; copied to a GPU every step they would make every
    decode step wait for the device. The number of host draws does not grow with the tokens."""
    from mllm_rl.bench.engine import dispatched_ops

    sampled = lambda n: SamplingParams(max_new_tokens=n, temperature=1.0, seed=1)  # noqa: E731
    counts = [
        dispatched_ops(lambda n=n: engine.generate(PROMPTS, sampled(n)), only=("rand", "uniform_"))
        for n in (2, 10)
    ]
    assert counts[0] == counts[1] == len(PROMPTS), counts

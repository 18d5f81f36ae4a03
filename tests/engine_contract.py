"""One rollout-engine contract for every engine (docs/DESIGN.md, "Contracts" and "The lifecycle"), engine-agnostic.

``run_contract(make_engine, model_dir, used)`` drives a ``ManagedEngine`` around
``make_engine(weights_cpu_backup)`` through a swap, generation, drain, release/resume and
update cycles and returns *observations* (JSON-able: the driver can run in the engine's own
process and venv, e.g. sglang-jax engines, which must not live in pytest's process). The
``assert_*`` helpers check them against an independent reference model given as a
``logits_fn(token_ids) -> [T, V] float32 logits`` (HF transformers, flax, ...).

Run as a script (prints one ``RESULT {json}`` line, then leaves through ``os._exit``)::

    python tests/engine_contract.py --backend torch [--engine embedded] [--platform cpu] CHECKPOINT_DIR

Imports only numpy and the core at module level, so every venv can load it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from mllm_rl.checkpoint.model_dir import ModelDir
from mllm_rl.engine import EngineOptions, EngineStateError, SamplingParams, WeightExport
from mllm_rl.engine_state import ManagedEngine

# Token ids valid for every preset (the shipped byte-level tokenizer has 384 ids).
PROMPTS = [[51, 71, 68, 220, 66, 64, 79], [160, 121, 254, 162], [72, 83, 64, 75]]
N_NEW = 8
GREEDY = SamplingParams(max_new_tokens=N_NEW)
SAMPLED = SamplingParams(max_new_tokens=N_NEW, temperature=0.8, top_p=0.9, seed=1234)
LONG = 400  # new tokens of the requests that are in flight when drain() is called
# The drain's requests: more than an sglang-jax engine runs at once (16 by default), so some are
# still queued, not yet prefilled, when the pause aborts them (that case once hung the pause).
DRAIN_PROMPTS = PROMPTS * 6
CYCLES = 3
GROUP = 4  # samples per prompt in a GRPO-shaped batch (every prompt ``GROUP`` times, in a row)
GROUP_PROMPTS = [[87, 101, 109, 32, 80, 97], [73, 54, 200]]  # sent nowhere else: not in a prefix cache
LONG_GREEDY = 64  # > 50: sglang-jax repeats its per-token list every 50 tokens

LogitsFn = Callable[[list[int]], np.ndarray]


def _outs(outs: Sequence[Any]) -> dict[str, list]:
    return {
        "tokens": [list(o.token_ids) for o in outs],
        "logprobs": [list(o.logprobs) for o in outs],
        "finish": [o.finish_reason for o in outs],
        "cached": [o.cached_tokens for o in outs],
    }


def _refused(fn: Callable[[], Any], exc: type[BaseException] = EngineStateError) -> str | None:
    """The error message of ``fn()``, or None when it did not raise ``exc``."""
    try:
        fn()
    except exc as e:
        return str(e)
    return None


def _warned(fn: Callable[[], Any], needle: str) -> tuple[Any, bool]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        result = fn()
    return result, any(needle in str(x.message) for x in w)


def run_contract(make_engine: Callable[[bool], Any], model_dir: str | Path, used: Callable[[], int | None],
                 last: Callable[[ManagedEngine], Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Drive two engines (without, then with weights CPU backup); return observations.

    ``make_engine(weights_cpu_backup)`` returns a fresh ``EnginePrimitives`` with dummy
    weights; ``used()`` is the device's bytes in use by the backend's probe (device truth);
    ``last(engine)``: a backend's own observation (``obs["last"]``), made last (it may break it).
    """
    model = ModelDir.open(model_dir)
    full = lambda: WeightExport(list(model.tensors), model.iter_tensors(), full=True)  # noqa: E731
    first = lambda: WeightExport.of(list(model.iter_tensors())[:1], full=False)  # noqa: E731
    obs: dict[str, Any] = {"prompts": PROMPTS, "eos": model.config.eos_token_id}

    eng = ManagedEngine(make_engine(False))
    greedy = lambda: _outs(eng.generate(PROMPTS, GREEDY))  # noqa: E731
    obs["names_match"] = sorted(eng.weight_names()) == sorted(model.tensors)
    stats = eng.update_weights(full())
    obs["update"] = {"tensors": stats.tensors, "bytes": stats.bytes, "checkpoint_bytes": model.nbytes}
    obs["swap"] = greedy()
    obs["long"] = _outs(eng.generate(PROMPTS[:2], SamplingParams(max_new_tokens=LONG_GREEDY)))
    stop_tok = obs["swap"]["tokens"][0][2]
    obs["stop"] = {
        "token": stop_tok,
        **_outs(eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=N_NEW, stop_token_ids=(stop_tok,)))),
    }
    obs["sampled"] = [_outs(eng.generate(PROMPTS, SAMPLED)) for _ in range(2)]
    obs["sampled_other_seed"] = _outs(eng.generate(PROMPTS, dataclasses.replace(SAMPLED, seed=99)))
    obs["grouped"] = _outs(eng.generate([p for p in GROUP_PROMPTS for _ in range(GROUP)], SAMPLED))
    obs["idle_cpu_cores"] = _idle_cpu_cores()
    obs["release_undrained"] = _refused(lambda: eng.release(["kv_cache"]))
    obs["drain"] = _drain_in_flight(eng)
    obs["paused_generate"] = _paused_generate(eng)
    for tag in ("kv_cache", "weights"):
        before = used()
        held = eng.release([tag])[tag]
        obs[f"{tag}_held"], obs[f"{tag}_freed"] = held, before - used()
    obs["refused_while_released"] = _refused(lambda: eng.generate(PROMPTS, GREEDY))
    obs["double_release"], obs["double_release_warned"] = _warned(
        lambda: eng.release(["kv_cache"]), "already"
    )
    obs["update_while_released"] = _refused(lambda: eng.update_weights(first()))
    obs["unknown_tag"] = _refused(lambda: eng.release(["no_such_tag"]), ValueError)
    eng.resume(["kv_cache", "weights"])  # no CPU backup: the weights are invalid now
    obs["double_resume"], obs["double_resume_warned"] = _warned(
        lambda: eng.resume(["kv_cache"]), "not released"
    )
    eng.continue_generation()
    obs["weights_valid_after_resume"] = eng.state()["weights_valid"]
    obs["refused_while_invalid"] = _refused(lambda: eng.generate(PROMPTS, GREEDY))
    obs["partial_on_invalid"] = _refused(lambda: eng.update_weights(first()))
    obs["refused_after_partial"] = _refused(lambda: eng.generate(PROMPTS, GREEDY))
    bogus = WeightExport.of([("model.layers.0.bogus.weight", None)], full=False)
    obs["unknown_name"] = _refused(lambda: eng.update_weights(bogus), ValueError)
    eng.update_weights(full())
    obs["after_full_sync"] = greedy()
    obs["cycles"] = []
    for _ in range(CYCLES):  # step 2+ is where offload bugs show up
        eng.drain()
        eng.release(["kv_cache", "weights"])
        eng.resume(["weights"])
        eng.update_weights(full())
        eng.resume(["kv_cache"])
        eng.continue_generation()
        obs["cycles"].append(greedy())
    eng.shutdown()

    eng = ManagedEngine(make_engine(True))
    eng.update_weights(full())
    obs["backup_reference"] = _outs(eng.generate(PROMPTS, GREEDY))
    eng.drain()
    before = used()
    held = eng.release(["weights", "kv_cache"])
    obs["backup_held"], obs["backup_freed"] = sum(held.values()), before - used()
    eng.resume(["weights", "kv_cache"])
    eng.continue_generation()
    obs["backup_weights_valid"] = eng.state()["weights_valid"]
    obs["after_backup_resume"] = _outs(eng.generate(PROMPTS, GREEDY))
    if last is not None:
        obs["last"] = last(eng)
    eng.shutdown()
    return obs


def _idle_cpu_cores(seconds: float = 1.0) -> float:
    """CPU time of this whole process (every engine thread) per second of wall time while the
    caller sleeps and the engine has nothing to do. An engine's own subprocesses (SGLang's
    schedulers) are not counted."""
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(seconds)
    return (time.process_time() - c0) / (time.perf_counter() - t0)


def _drain_in_flight(eng: ManagedEngine) -> dict[str, Any]:
    """Generate long requests in another thread and drain while they are in flight."""
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["outs"] = _outs(eng.generate(DRAIN_PROMPTS, SamplingParams(max_new_tokens=LONG)))
        except Exception as e:  # reported, never lost
            result["error"] = f"{type(e).__name__}: {e}"

    th = threading.Thread(target=work, daemon=True)
    th.start()
    deadline = time.time() + 60
    while eng.state()["in_flight"] == 0 and th.is_alive() and time.time() < deadline:
        time.sleep(0.005)
    time.sleep(0.1)  # let them decode a few tokens (they are LONG: still running after this)
    info = eng.drain(timeout_s=120)
    th.join(timeout=120)
    return {**info, "returned": not th.is_alive(), "state": eng.state(), **result}


def _paused_generate(eng: ManagedEngine) -> dict[str, Any]:
    """The adapter's own ``generate`` of a batch of groups while paused (after a drain; the
    ``ManagedEngine`` would refuse it): every request must come back aborted, at once. sglang-jax
    holds a request sent while paused until ``continue_generation``: a batch sent then would hang."""
    result: dict[str, Any] = {}

    def work() -> None:
        result["outs"] = _outs(eng.engine.generate(DRAIN_PROMPTS, GREEDY))

    th = threading.Thread(target=work, daemon=True)
    th.start()
    th.join(timeout=30)
    return {"returned": not th.is_alive(), **result}


# -- reference checks ----------------------------------------------------------------------
def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def reference_greedy(
    logits_fn: LogitsFn, prompt: list[int], n: int, eos: int
) -> tuple[list[int], list[float]]:
    """Greedy decoding by full re-forward; (tokens [<= n], logprobs)."""
    ids, toks, lps = list(prompt), [], []
    for _ in range(n):
        lp = _log_softmax(logits_fn(ids)[-1])
        t = int(lp.argmax())
        toks.append(t)
        lps.append(float(lp[t]))
        ids.append(t)
        if t == eos:
            break
    return toks, lps


def reference_logprobs(
    logits_fn: LogitsFn, prompt: list[int], tokens: list[int], temperature: float
) -> list[float]:
    """``log_softmax(logits / T)`` (T = 1 when greedy) of each of ``tokens`` after ``prompt``."""
    if not tokens:
        return []
    logits = logits_fn(list(prompt) + list(tokens)[:-1])[len(prompt) - 1 :]
    lp = _log_softmax(logits / (temperature or 1.0))
    return [float(lp[i, t]) for i, t in enumerate(tokens)]


def assert_greedy_matches_reference(out: dict, logits_fn: LogitsFn, eos: int, atol: float = 1e-3) -> None:
    for prompt, toks, lps in zip(PROMPTS, out["tokens"], out["logprobs"], strict=True):
        ref_toks, ref_lps = reference_greedy(logits_fn, prompt, N_NEW, eos)
        assert toks == ref_toks, (prompt, toks, ref_toks)
        assert np.allclose(lps, ref_lps, atol=atol), (lps, ref_lps)


def assert_sampled_logprobs_match_reference(out: dict, logits_fn: LogitsFn, temperature: float,
                                            atol: float = 1e-3, prompts: Sequence[list[int]] = PROMPTS) -> None:  # fmt: skip
    for prompt, toks, lps in zip(prompts, out["tokens"], out["logprobs"], strict=True):
        assert len(toks) == len(lps) > 0
        assert np.allclose(lps, reference_logprobs(logits_fn, prompt, toks, temperature), atol=atol)


def assert_release_frees(obs: dict, frac: float = 0.99) -> None:
    for tag in ("kv_cache", "weights"):
        assert obs[f"{tag}_held"] > 0, tag
        assert obs[f"{tag}_freed"] >= frac * obs[f"{tag}_held"], (
            tag,
            obs[f"{tag}_freed"],
            obs[f"{tag}_held"],
        )
    assert obs["backup_freed"] >= frac * obs["backup_held"] > 0


def assert_state_machine(obs: dict) -> None:
    """Every refusal the lifecycle relies on happened, with its reason."""
    assert "drain() first" in obs["release_undrained"]
    assert "memory released" in obs["refused_while_released"]
    assert "weights are released" in obs["update_while_released"]
    assert obs["double_release"] == {} and obs["double_release_warned"]
    assert obs["double_resume"] == {} and obs["double_resume_warned"]
    assert "unknown memory tag" in obs["unknown_tag"]
    assert obs["weights_valid_after_resume"] is False
    assert "weights are invalid" in obs["refused_while_invalid"]
    assert "partial update on invalid weights" in obs["partial_on_invalid"]
    assert "weights are invalid" in obs["refused_after_partial"]
    assert "unknown parameter" in obs["unknown_name"]


def assert_drain_lost_nothing(obs: dict) -> None:
    d = obs["drain"]
    assert d["returned"] and "error" not in d, d.get("error")
    assert d["in_flight_at_pause"] == len(DRAIN_PROMPTS), "drain() ran with no request in flight"
    assert len(d["outs"]["tokens"]) == len(DRAIN_PROMPTS)
    assert set(d["outs"]["finish"]) <= {"stop", "length", "abort"}
    assert d["aborted"] == d["outs"]["finish"].count("abort") >= 1, (
        "nothing was cut short: not a drain under load"
    )
    for toks, lps, why in zip(d["outs"]["tokens"], d["outs"]["logprobs"], d["outs"]["finish"], strict=True):
        assert len(toks) == len(lps) and (why != "abort" or len(toks) < LONG)
    assert d["state"]["in_flight"] == 0 and d["state"]["paused"]


def assert_stop_token(obs: dict) -> None:
    s = obs["stop"]
    want = obs["swap"]["tokens"][0]
    cut = want.index(s["token"]) + 1
    assert s["tokens"] == [want[:cut]] and s["finish"] == ["stop"]


def assert_seeded_sampling_reproducible(obs: dict) -> None:
    a, b = obs["sampled"]
    assert a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]
    assert obs["sampled_other_seed"]["tokens"] != a["tokens"], "the seed has no effect"
    assert a["tokens"] != obs["swap"]["tokens"], "temperature sampling returned the greedy tokens"


# -- the checks as pytest tests ---------------------------------------------------------------
# A backend's test module imports these and provides two fixtures: ``obs`` (the driver's
# observations for one engine) and ``ref_logits`` (an independent reference model's logits_fn).
def test_swap_matches_the_reference_model(obs, ref_logits):
    assert obs["names_match"]
    assert obs["update"]["tensors"] == 25 and obs["update"]["bytes"] == obs["update"]["checkpoint_bytes"]
    assert_greedy_matches_reference(obs["swap"], ref_logits, obs["eos"])


def test_long_greedy_completions_match_the_reference(obs, ref_logits):
    """Past 50 tokens (sglang-jax's streaming interval) tokens and logprobs still line up."""
    out = obs["long"]
    assert max(len(t) for t in out["tokens"]) > 50, "the check needs a completion longer than 50 tokens"
    for prompt, toks, lps in zip(PROMPTS, out["tokens"], out["logprobs"], strict=False):
        want, want_lp = reference_greedy(ref_logits, prompt, LONG_GREEDY, obs["eos"])
        assert toks == want and len(lps) == len(toks)
        assert np.allclose(lps, want_lp, atol=1e-3)


def test_an_idle_engine_does_not_spin(obs):
    """With nothing to generate the engine waits: it takes no core from the trainer (an
    sglang-jax scheduler polling its sockets in a loop used a whole one)."""
    assert obs["idle_cpu_cores"] < 0.25, obs["idle_cpu_cores"]


def test_release_frees_each_tag_by_the_probe(obs):
    assert_release_frees(obs)


def test_state_machine_refusals(obs):
    assert_state_machine(obs)


def test_resume_without_backup_needs_a_full_update(obs):
    assert obs["after_full_sync"]["tokens"] == obs["swap"]["tokens"]


def test_resume_with_backup_is_identical(obs):
    assert obs["backup_weights_valid"] is True
    assert obs["after_backup_resume"] == obs["backup_reference"]
    assert obs["backup_reference"]["tokens"] == obs["swap"]["tokens"]


def test_drain_with_requests_in_flight_loses_none(obs):
    assert_drain_lost_nothing(obs)


def test_three_release_resume_update_cycles_keep_greedy_output(obs):
    """Step 2+ is where offload bugs show (an unchecked flush left stale prefixes in sglang-jax)."""
    assert len(obs["cycles"]) == CYCLES
    assert all(c["tokens"] == obs["swap"]["tokens"] for c in obs["cycles"])


def test_stop_tokens(obs):
    assert_stop_token(obs)


def test_a_generate_while_paused_comes_back_aborted(obs):
    d = obs["paused_generate"]
    assert d["returned"], "a generate sent while paused did not return"
    assert d["outs"]["finish"] == ["abort"] * len(DRAIN_PROMPTS) and not any(d["outs"]["tokens"])


def test_seeded_sampling_is_reproducible(obs):
    assert_seeded_sampling_reproducible(obs)


def test_logprobs_are_the_reference_log_softmax_at_the_sampled_tokens(obs, ref_logits):
    for out in (*obs["sampled"], obs["sampled_other_seed"]):
        assert_sampled_logprobs_match_reference(out, ref_logits, SAMPLED.temperature)


def test_a_batch_of_groups_samples_each_request_from_its_own_prompt(obs, ref_logits):
    """Every prompt ``GROUP`` times in one batch, as a rollout sends it: each sample's log-probs are
    the reference's for its prompt (an engine that serves a group's prompt from its prefix cache
    must serve the right one), and the samples of a group differ (one seed per request)."""
    out = obs["grouped"]
    grouped = [p for p in GROUP_PROMPTS for _ in range(GROUP)]
    assert_sampled_logprobs_match_reference(out, ref_logits, SAMPLED.temperature, prompts=grouped)
    for g in range(len(GROUP_PROMPTS)):
        assert len({tuple(t) for t in out["tokens"][g * GROUP : (g + 1) * GROUP]}) > 1, out["tokens"]


CONTRACT_TESTS = {name: fn for name, fn in list(globals().items()) if name.startswith("test_")}


# -- script entry (one engine's contract in its own process) --------------------------------
def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--backend", required=True)
    ap.add_argument("--engine", default=None, help="backend engine choice (torch: embedded, sglang, auto)")
    ap.add_argument("--platform", default="auto", help="asserted by the backend's init_runtime")
    args = ap.parse_args(argv)
    from mllm_rl.backend_registry import load_backend

    backend = load_backend(args.backend)
    backend.init_runtime(tp=1, platform=args.platform)
    probe = backend.memory_probe()
    model = ModelDir.open(args.checkpoint)

    def make_engine(backup: bool) -> Any:
        return backend.create_engine(
            model, EngineOptions(engine=args.engine or "auto", weights_cpu_backup=backup)
        )

    last = _scheduler_dies if args.backend == "jax" else None
    return run_contract(make_engine, model.path, lambda: probe.in_use()[0], last)


def _scheduler_dies(eng: ManagedEngine) -> dict[str, Any]:
    """sglang-jax: the forward raises in the scheduler's thread (as a GPU kernel fault does); the
    waiting ``generate`` must fail within seconds naming that error, the process live on."""
    scheduler = eng.engine.engine.scheduler_info["scheduler"]

    def forward_fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected: the forward failed")

    scheduler.tp_worker.forward_batch_generation = forward_fails
    t0 = time.perf_counter()
    error = _refused(lambda: eng.generate(PROMPTS, GREEDY), Exception)
    return {"error": error, "seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
    sys.stdout.flush()
    os._exit(0)

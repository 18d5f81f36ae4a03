"""Engine throughput: greedy decode tokens/s of our rollout engines vs Hugging Face ``generate``.

    python -m mllm_rl.bench engine --backend torch --preset tiny --batch 1,32 [--json OUT]
    python -m mllm_rl.bench engine --backend jax --preset tiny --batch 1,32     # sglang-jax vs HF
    python -m mllm_rl.bench engine --engines embedded,hf,sglang --platform cuda --preset qwen3-0.6b

Engines (``embedded``, ``hf``, ``sglang`` under ``--python-torch``; ``sglang-jax`` under
``--python-jax``), each in fresh processes (``--rounds``, interleaved) on the same model and prompts.
Per batch B: ``t1`` / ``tN`` = a generate of 1 / ``--new-tokens`` N tokens, back to back
``--repeats`` times; decode tok/s = median B (N - 1) / (tN - t1), e2e and prefill from the fastest
runs, each also over HF's; ``greedy = hf``: the share of sequences equal to HF's.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from mllm_rl.bench.child import BenchError, bench_argv, flags, run_json
from mllm_rl.bench.cli import csv_choice, csv_list, output_flags, pick, positive, progress, run_bench
from mllm_rl.bench.machine import ROOT, bench_json  # ROOT: the venvs .venv-torch / .venv-jax live here
from mllm_rl.bench.tables import table

ENGINES = ("embedded", "hf", "sglang-jax", "sglang")
NEEDS = {"embedded": "torch", "hf": "torch", "sglang": "torch", "sglang-jax": "jax"}
DEFAULT_ENGINES = {"torch": ["embedded", "hf"], "jax": ["sglang-jax", "hf"]}
HARD_EXIT = True  # the driver leaves without interpreter teardown (sglang-jax's threads abort it)


# -- worker (one engine, in its own process) ----------------------------------------------
def prompts(seed: int, batch: int, length: int) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng([seed, batch, length])
    return rng.integers(32, 127, size=(batch, length)).tolist()  # printable bytes of the shipped tokenizer


def load(args: argparse.Namespace) -> tuple[Any, Any, dict[str, Any]]:
    """A one-process bench's backend ``args.backend``, model ``args.preset`` and runtime on ``args.platform``."""
    from mllm_rl.backend_registry import load_backend
    from mllm_rl.checkpoint.resolve import resolve_model

    backend = load_backend(args.backend)
    return backend, resolve_model(args.preset, seed=args.seed), backend.init_runtime(tp=1, platform=args.platform)  # fmt: skip


def start_engine(backend: Any, model: Any, **opts: Any) -> tuple[Any, Callable[[], Any]]:
    """A ``ManagedEngine`` on ``model`` (``EngineOptions(**opts)``), and the model's full weight export."""
    from mllm_rl.engine import EngineOptions, WeightExport
    from mllm_rl.engine_state import ManagedEngine

    full = lambda: WeightExport(list(model.tensors), model.iter_tensors(), full=True)  # noqa: E731
    return ManagedEngine(backend.create_engine(model, EngineOptions(**opts))), full


class _Managed:
    """Our engines through ``ManagedEngine``: (prompts, n) -> token lists."""

    def __init__(self, kind: str, model: Any, platform: str, max_batch: int, ctx: int) -> None:
        from mllm_rl.backend_registry import load_backend

        backend = load_backend("jax" if kind == "sglang-jax" else "torch")
        self.runtime = backend.init_runtime(tp=1, platform=platform)
        self.engine, full = start_engine(backend, model, max_total_tokens=max_batch * ctx, context_length=ctx,
            max_running_requests=max_batch, engine="auto" if kind == "sglang-jax" else kind)  # fmt: skip
        self.engine.update_weights(full())

    def __call__(self, ids: list[list[int]], n: int) -> list[list[int]]:
        from mllm_rl.engine import SamplingParams

        outs = self.engine.generate(ids, SamplingParams(max_new_tokens=n, temperature=0.0))
        return [o.token_ids for o in outs]

    def close(self) -> None:
        self.engine.shutdown()


class HFGenerate:
    """HF transformers ``generate`` on the checkpoint, greedy: (prompts, n) -> token lists."""

    def __init__(self, model: Any, platform: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        cuda = torch.cuda.is_available() and platform not in ("cpu",)
        self.device = torch.device("cuda" if cuda else "cpu")
        kind = next(iter(model.tensors.values()))[1].dtype
        dtype = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[kind]
        self.model = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=dtype).to(self.device).eval()
        if self.device.type == "cpu":
            same_products(self.model)
        self.eos = model.config.eos_token_id
        self.runtime = {"platform": self.device.type, "torch_version": torch.__version__}

    def __call__(self, ids: list[list[int]], n: int) -> list[list[int]]:
        t = self.torch.tensor(ids, device=self.device)
        with self.torch.no_grad():
            out = self.model.generate(input_ids=t, attention_mask=self.torch.ones_like(t), max_new_tokens=n,
                                      min_new_tokens=n, do_sample=False, pad_token_id=self.eos)  # fmt: skip
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()
        return out[:, t.shape[1] :].tolist()

    def close(self) -> None:
        pass


def same_products(model: Any) -> None:
    """HF's bias-free linear layers through ``cpu_half.linear``, as the embedded engine's: on CPU a
    16-bit checkpoint's products then run the same GEMM in both, and the ratio compares engines."""
    from torch import nn

    from mllm_rl.backends.torch.cpu_half import linear

    for m in model.modules():
        if isinstance(m, nn.Linear) and m.bias is None:
            m.forward = lambda x, m=m: linear(x, m.weight)


def dispatched_ops(fn: Callable[[], Any], only: tuple[str, ...] = ()) -> int:
    """The aten ops ``fn()`` dispatches, views excluded (no kernel): on a GPU, about its kernel
    launches. ``only``: count just the ops of these names (e.g. ``("rand",)``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    skip = ("_unsafe_view", "detach", "_local_scalar_dense")

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            name = func.overloadpacket.__name__
            self.n += name in only if only else not func.is_view and name not in skip
            return func(*args, **(kwargs or {}))

    with Count() as c:
        fn()
    return c.n


def ops_per_step(eng: Callable[[list[list[int]], int], Any], ids: list[list[int]]) -> float:
    """Ops one decode step of ``eng`` dispatches: a 10-token generate's minus a 2-token one's, / 8;
    16-bit products counted as a GPU runs them (one op, not the CPU's float32 path)."""
    from mllm_rl.backends.torch.cpu_half import dispatched_as_on_gpu

    with dispatched_as_on_gpu():
        return (dispatched_ops(lambda: eng(ids, 10)) - dispatched_ops(lambda: eng(ids, 2))) / 8


def rates(b: int, p: int, n: int, n_gen: int, t1s: list[float], tns: list[float]) -> dict[str, Any]:
    """Throughputs of all repeats and rounds: decode = median of B (N - 1) / (tN - t1) over pairs timed
    back to back (they share the machine's load); e2e / prefill from the fastest tN / t1."""
    pair = [b * (n - 1) / (tn - t1) for t1, tn in zip(t1s, tns, strict=True) if tn > t1]
    t1, tn = min(t1s), min(tns)
    return {"t1_s": round(statistics.median(t1s), 5), "tN_s": round(statistics.median(tns), 5),
        "t1_s_best": round(t1, 5), "tN_s_best": round(tn, 5),
        "decode_tok_s": round(statistics.median(pair), 2) if pair else None,
        "decode_pairs_used": f"{len(pair)}/{len(t1s)}", "e2e_tok_s_best": round(n_gen / tn, 2),
        "prefill_tok_s_best": round(b * p / t1, 2)}  # fmt: skip


def worker(args: argparse.Namespace) -> dict[str, Any]:
    from mllm_rl.checkpoint.resolve import resolve_model

    model = resolve_model(args.preset, seed=args.seed)
    ctx = args.prompt_len + args.new_tokens + 1
    ctx = 1 << (ctx - 1).bit_length()
    kind = args.worker
    t0 = time.perf_counter()
    eng = (
        HFGenerate(model, args.platform)
        if kind == "hf"
        else _Managed(kind, model, args.platform, max(args.batch), ctx)
    )
    start_s = time.perf_counter() - t0
    rows = []
    for b in args.batch:
        ids = prompts(args.seed, b, args.prompt_len)
        eng(ids, args.new_tokens)  # warm-up: compilation / allocator growth for these shapes
        eng(ids, 1)
        t1s, tns, toks = [], [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            eng(ids, 1)
            t1s.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            toks = eng(ids, args.new_tokens)
            tns.append(time.perf_counter() - t0)
        toks = toks or []
        ops = ops_per_step(eng, ids) if kind in ("embedded", "hf") else None  # in this process: torch ops
        over = sum(len(t) > args.new_tokens for t in toks)  # an engine must never return more than asked
        toks = [t[: args.new_tokens] for t in toks]
        rows.append({"batch": b, "generated_tokens": sum(len(t) for t in toks), "over_length_outputs": over,
                     "tokens": toks, "t1_all": t1s, "tN_all": tns, "ops_per_step": ops})  # fmt: skip
    eng.close()
    return {"engine": kind, "runtime": eng.runtime, "start_s": round(start_s, 3), "rows": rows,
        "python": sys.executable}  # fmt: skip


# -- driver ----------------------------------------------------------------------------------
def python_for(engine: str, args: argparse.Namespace) -> str:
    need = NEEDS[engine]
    given = args.python_torch if need == "torch" else args.python_jax
    if given:
        return given
    module = "torch" if need == "torch" else "sgl_jax"
    if importlib.util.find_spec(module) is not None:
        return sys.executable
    venv = ROOT / (".venv-torch" if need == "torch" else ".venv-jax") / "bin" / "python"
    if venv.exists():
        return str(venv)
    raise BenchError(f"engine {engine}: no interpreter with {module}; pass --python-{need}")


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from mllm_rl.checkpoint.resolve import resolve_model

    resolve_model(args.preset, seed=args.seed)
    engines = args.engines or DEFAULT_ENGINES[args.backend]
    results: dict[str, Any] = {}
    for rnd in range(args.rounds):  # engines interleaved round by round: load changes hit them alike
        for e in engines:
            if "error" in results.get(e, {}):
                continue
            cmd = bench_argv("engine", "--worker", e, python=python_for(e, args))
            cmd += flags(
                preset=args.preset, batch=",".join(map(str, args.batch)), prompt_len=args.prompt_len,
                new_tokens=args.new_tokens, repeats=args.repeats, platform=args.platform, seed=args.seed,
            )  # fmt: skip
            progress(f"  round {rnd + 1}/{args.rounds}: {e} ...")
            try:
                res = run_json(cmd, f"engine {e}", timeout=args.timeout)
            except BenchError as err:
                if not args.keep_going:
                    raise
                results[e] = {"engine": e, "error": str(err)[:2000]}
                continue
            if e not in results:
                results[e] = {**res, "start_s_all": [res["start_s"]]}
                continue
            results[e]["start_s_all"].append(res["start_s"])
            for r0, r in zip(results[e]["rows"], res["rows"], strict=True):
                r0["t1_all"] += r["t1_all"]
                r0["tN_all"] += r["tN_all"]
    per_engine = {e: {r["batch"]: {**r, **rates(r["batch"], args.prompt_len, args.new_tokens,
        r["generated_tokens"], r["t1_all"], r["tN_all"])} for r in res.get("rows", [])}
        for e, res in results.items()}  # fmt: skip
    hf_rows, rows = per_engine.get("hf", {}), []
    for e, by_batch in per_engine.items():
        for b, r in by_batch.items():
            h = hf_rows.get(b)
            pairs = zip(r["tokens"], h["tokens"], strict=True) if h is not None and e != "hf" else None
            same = round(statistics.fmean(x == y for x, y in pairs), 3) if pairs else None
            d, hd = r["decode_tok_s"], h and h["decode_tok_s"]
            ratio = round(d / hd, 3) if d and hd else None
            rows.append({"engine": e, **{k: v for k, v in r.items() if k not in ("tokens", "t1_all", "tN_all")},
                "timings_t1": [round(x, 5) for x in r["t1_all"]], "timings_tN": [round(x, 5) for x in r["tN_all"]],
                "decode_over_hf": ratio,
                "e2e_over_hf": round(r["e2e_tok_s_best"] / h["e2e_tok_s_best"], 3) if h else None,
                "greedy_equal_hf": same})  # fmt: skip
    return bench_json("engine", args,
        ("backend", "preset", "prompt_len", "new_tokens", "repeats", "rounds", "platform"), rows=rows,
        engines={e: {k: v for k, v in r.items() if k != "rows"} for e, r in results.items()})  # fmt: skip


def report(out: dict[str, Any]) -> str:
    cols = [("engine", "engine", ""), ("batch", "batch", ""), ("t1_s", "t1 s", ".4f"),
        ("tN_s", "tN s", ".4f"), ("decode_tok_s", "decode tok/s", ".1f"),
        ("decode_pairs_used", "pairs", ""), ("e2e_tok_s_best", "e2e tok/s (best)", ".1f"),
        ("prefill_tok_s_best", "prefill tok/s (best)", ".1f"), ("decode_over_hf", "decode / hf", ".3f"),
        ("e2e_over_hf", "e2e / hf", ".3f"), ("greedy_equal_hf", "greedy = hf", ".3f"),
        ("over_length_outputs", "> N tokens", ""), ("ops_per_step", "ops/step", ".0f")]  # fmt: skip
    head = (
        f"engine throughput {out['preset']} (prompt {out['prompt_len']}, {out['new_tokens']} new tokens, "
        f"{out['repeats']} repeats x {out['rounds']} rounds: medians, 'best' = fastest; platform {out['platform']})"
    )
    lines = [
        head,
        table(out["rows"], cols),
        "ops/step: torch ops one decode step dispatches, views excluded, "
        "counted here (on a GPU about one kernel launch each; torch engines only)",
    ]
    lines += [f"{e}: FAILED: {i['error'].splitlines()[0]}" if "error" in i else
              f"{e}: started in {min(i['start_s_all']):.2f} s on {i['runtime'].get('platform')} ({i['python']})"
              for e, i in out["engines"].items()]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Details: docs/BENCHMARKS.md")
    # fmt: off
    ap.add_argument("--backend", default="torch", choices=["jax", "torch"],
                    help="default engines: torch -> embedded,hf; jax -> sglang-jax,hf")
    ap.add_argument("--engines", type=csv_choice(ENGINES), default=None, help="comma-separated; overrides --backend")
    ap.add_argument("--preset", default="tiny", help="preset name or checkpoint dir")
    ap.add_argument("--platform", default="auto", choices=["auto", "cpu", "gpu", "cuda"])
    ap.add_argument("--batch", type=csv_list(int, 1, "integers"), default=[1, 32], help="batch sizes, comma-separated")
    ap.add_argument("--prompt-len", type=positive(int), default=16)
    ap.add_argument("--new-tokens", type=positive(int), default=64)
    ap.add_argument("--repeats", type=positive(int), default=3, help="timed generates per length and process")
    ap.add_argument("--rounds", type=positive(int), default=2, help="fresh processes per engine, interleaved")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--python-torch", default=None, help="interpreter for embedded/hf/sglang")
    ap.add_argument("--python-jax", default=None, help="interpreter for sglang-jax")
    ap.add_argument("--keep-going", action="store_true", help="report a failing engine and go on")
    output_flags(ap, per="engine")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    # fmt: on
    args = ap.parse_args(argv)
    if args.new_tokens < 2:
        print("error: --new-tokens must be >= 2 (decode rate = tokens after the first)", file=sys.stderr)
        return 2
    args.platform = "gpu" if args.platform == "cuda" and args.worker == "sglang-jax" else args.platform
    if args.worker:
        return run_bench(worker, args, lambda o: "", lambda o: o)[0]
    keys = ("engine", "batch", "decode_tok_s", "decode_over_hf", "ops_per_step")
    return run_bench(bench, args, report, lambda o: {"bench": "engine", "rows": [pick(r, keys) for r in o["rows"]]})[0]  # fmt: skip

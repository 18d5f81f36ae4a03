"""Reproduce: sglang-jax on JAX CPU decodes batched greedy requests inconsistently, and
only with its overlap scheduler on.

    python scripts/repro_sglang_jax_tp_batch.py [--trials 8] [--tp 2] [--model tiny] [--overlap on|off|both]

Each trial is a fresh process running sglang-jax's own loader (``load_format="auto"``, no
mllm_rl swap involved) on the same checkpoint and the same two prompts, greedy. It counts
how many trials differ from the most common output, for batched requests (both prompts in
one ``generate``) and for one request at a time, with the overlap scheduler on (sglang-jax's
default) and/or off (``disable_overlap_schedule=True``). Prints one JSON line.

Cause (docs/ENGINES.md): on JAX CPU, ``jax.device_put`` of a numpy *view* aliases it, and the
scheduler's per-step KV locations are a view into one persistent host buffer that the overlap
thread rewrites for the next step while the current forward may still read it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys

CHILD = r"""
import json, os, sys
from sgl_jax.srt.entrypoints.engine import Engine
ck, tp, batched, overlap = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4] == "1"
e = Engine(model_path=ck, tokenizer_path=ck, load_format="auto", enable_single_process=True, device="cpu",
           tp_size=tp, mem_fraction_static=0.1, max_total_tokens=4096, context_length=512,
           max_running_requests=16, disable_precompile=True, skip_server_warmup=True,
           grammar_backend="none", random_seed=0, log_level="error", disable_overlap_schedule=not overlap)
prompts = [[160, 121, 254, 162, 246, 107, 164, 108, 223],
           [51, 71, 68, 220, 66, 64, 79, 72, 83, 64, 75, 220, 78, 69, 220, 37, 81, 64, 77, 66, 68, 220, 72, 82]]
sp = {"temperature": 0, "max_new_tokens": 8}
outs = e.generate(input_ids=prompts, sampling_params=sp) if batched else [e.generate(input_ids=p, sampling_params=sp) for p in prompts]
print("OUT " + json.dumps([o["output_ids"] for o in outs]), flush=True)
e.shutdown()
os._exit(0)
"""


def trial(ckpt: str, tp: int, batched: bool, overlap: bool) -> str:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={tp}", "JAX_PLATFORMS": "cpu"}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, ckpt, str(tp), "1" if batched else "0", "1" if overlap else "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    lines = [x for x in r.stdout.splitlines() if x.startswith("OUT ")]
    return lines[0][4:] if lines else f"error: {r.stderr[-300:]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument(
        "--overlap",
        default="both",
        choices=["on", "off", "both"],
        help="sglang-jax's overlap scheduler (on is its default)",
    )
    args = ap.parse_args()
    from mllm_rl.checkpoint.resolve import resolve_model

    ckpt = str(resolve_model(args.model).path)
    result = {"tp": args.tp, "trials": args.trials, "model": args.model}
    for overlap in {"on": [True], "off": [False], "both": [True, False]}[args.overlap]:
        for batched in (True, False):
            outs = [trial(ckpt, args.tp, batched, overlap) for _ in range(args.trials)]
            common, n = collections.Counter(outs).most_common(1)[0]
            key = f"{'batched' if batched else 'one_at_a_time'}_overlap_{'on' if overlap else 'off'}"
            result[key] = {"differing_trials": args.trials - n, "distinct_outputs": len(set(outs))}
    print(json.dumps(result))


if __name__ == "__main__":
    main()

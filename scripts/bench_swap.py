"""Param-swap benchmark: streaming vs naive, side by side in one run.

    python scripts/bench_swap.py --preset tiny [--tp N] [--dtype bfloat16] [--json OUT]

For each mode it runs ``python -m mllm_rl.run --plan swap`` in its own process (fresh
device memory each time), reads the ``weights_swapped`` record and prints, per mode:
``peak_during_swap / steady_after_swap`` (max over devices of the phase peak divided
by bytes in use at the end of the phase) and GB/s of the swap. Target for streaming:
<= 1.10 (MLLM-JAX measured 3.90/2.01 = 1.94 on a v4-8 with the naive path).

The steady value includes everything on the device (engine KV cache too), as in the
MLLM-JAX measurement; ``weights_only`` also prints (peak - non-weight) / weights.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mllm_rl.sinks.jsonl import read_jsonl  # noqa: E402


def run_mode(mode: str, model: str, tp: int, backend: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-m", "mllm_rl.run", "--backend", backend, "--plan", "swap", "--model", model,
               "--tp", str(tp), "--swap-mode", mode, "--wandb", "disabled", "--quiet", "--run-dir", d,
               "--max-new-tokens", "4", *extra]  # fmt: skip
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"{mode} run failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
        recs = {x["phase"]: x for x in read_jsonl(Path(d) / "phases.jsonl")}
    sw = recs["weights_swapped"]
    devs = sw["memory"]["devices"]
    weights = sw["info"]["bytes"]
    per_dev_weights = weights / max(1, len(devs)) if tp > 1 else weights
    ratios, w_ratios = [], []
    for dev in devs:
        steady, peak = dev["bytes_in_use"], dev["phase_peak_bytes"]
        if steady and peak:
            ratios.append(peak / steady)
            other = steady - per_dev_weights
            w_ratios.append((peak - other) / per_dev_weights)
    return {
        "mode": mode,
        "platform": devs[0]["platform"] if devs else None,
        "source": devs[0]["source"] if devs else None,
        "devices": len(devs),
        "weight_bytes": weights,
        "steady_bytes_max": max(d["bytes_in_use"] for d in devs),
        "peak_bytes_max": max(d["phase_peak_bytes"] for d in devs),
        "peak_over_steady": round(max(ratios), 4),
        "weights_only_ratio": round(max(w_ratios), 4),
        "swap_seconds": sw["info"]["seconds"],
        "gbps": sw["info"]["gbps"],
        "host_rss_peak_bytes": sw["memory"]["host"]["rss_peak_bytes"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", help="preset name or checkpoint dir")
    ap.add_argument("--backend", default="jax")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("extra", nargs="*", help="extra args for mllm_rl.run (after --)")
    args = ap.parse_args()
    rows = [run_mode(m, args.preset, args.tp, args.backend, args.extra) for m in ("streaming", "naive")]
    print(f"{'mode':<10} {'peak/steady':>11} {'weights-only':>12} {'peak GiB':>9} {'steady GiB':>10} {'GB/s':>7}  source")
    for r in rows:
        print(f"{r['mode']:<10} {r['peak_over_steady']:>11.3f} {r['weights_only_ratio']:>12.3f} "
              f"{r['peak_bytes_max'] / 2**30:>9.3f} {r['steady_bytes_max'] / 2**30:>10.3f} {r['gbps']:>7.3f}  "
              f"{r['platform']}/{r['source']}")  # fmt: skip
    s, n = rows
    print(f"naive/streaming peak: {n['peak_bytes_max'] / s['peak_bytes_max']:.3f}")
    if args.json:
        args.json.write_text(json.dumps({"preset": args.preset, "tp": args.tp, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()

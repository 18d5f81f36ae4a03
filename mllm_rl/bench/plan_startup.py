"""Start-up cost of the plan compilers, and proof that a plain CPU run does not pay it.

    python -m mllm_rl.bench plan-startup [--repeats 3] [--json OUT]

Each case runs in a fresh interpreter of this venv (median of ``--repeats``), measuring wall
time and the child's peak RSS:

- ``plain``: ``import jax; jax.devices()`` as every CPU run starts (the compilers live in
  ``<venv>/plan-compilers``, off ``sys.path``): no plugin module may be imported;
- ``on_path``: the same with that directory on ``sys.path``, i.e. what installing libtpu and the
  CUDA plugin into site-packages would cost every run (JAX loads every plugin it finds);
- ``on_path_cpu``: that, with ``JAX_PLATFORMS=cpu`` (libtpu stays unloaded, the CUDA plugin not);
- ``plan_v4_8`` / ``plan_h100x8``: the planner's own set-up for a target (``topologies.prepare``
  + ``devices``: libtpu's topology and HBM probe / the CUDA plugin's topology).

Exit 0 when ``plain`` imported no plugin, 1 otherwise, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

from mllm_rl.bench import MiB
from mllm_rl.bench.cli import output_flags, positive, run_bench
from mllm_rl.bench.machine import ROOT, bench_json
from mllm_rl.bench.tables import table

CHILD = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
case, comp = sys.argv[1], sys.argv[2]
if case.startswith("on_path"):
    sys.path.insert(0, comp)
if case.startswith("plan_"):
    from mllm_rl.backends.jax import topologies
    spec = topologies.spec({"plan_v4_8": "v4-8", "plan_h100x8": "h100x8"}[case])
    topologies.prepare(spec)
    devs, target = topologies.devices(spec)
    n = len(devs)
else:
    import jax
    n = len(jax.devices())
mods = sorted(m for m in ("libtpu", "jax_cuda12_plugin", "jax_plugins.xla_cuda12") if m in sys.modules)
print(json.dumps({"seconds": time.perf_counter() - t0, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "devices": n, "plugins": mods}))
"""
CASES = ("plain", "on_path", "on_path_cpu", "plan_v4_8", "plan_h100x8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument("--repeats", type=positive(), default=3)
    output_flags(ap, timeout=None)
    return ap.parse_args(argv)


def _one(case: str, comp: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    if case == "on_path_cpu":
        env["JAX_PLATFORMS"] = "cpu"
    r = subprocess.run(
        [sys.executable, "-c", CHILD, case, comp],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    if r.returncode != 0:
        raise ValueError(f"{case}: child failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from mllm_rl.backends.jax.topologies import compilers_dir

    comp = str(compilers_dir())
    if not os.path.isdir(comp):
        raise ValueError(f"{comp}: not found (scripts/venv.sh jax installs the plan compilers there)")
    rows = []
    for case in CASES:
        runs = [_one(case, comp) for _ in range(args.repeats)]
        rows.append(
            {
                "case": case,
                "seconds": statistics.median(r["seconds"] for r in runs),
                "rss_mib": statistics.median(r["rss"] for r in runs) / MiB,
                "devices": runs[0]["devices"],
                "plugins": ",".join(runs[0]["plugins"]) or "none",
            }
        )
    base = rows[0]
    for r in rows:
        r["x_time"] = r["seconds"] / base["seconds"]
        r["x_rss"] = r["rss_mib"] / base["rss_mib"]
    return bench_json("plan_startup", args, compilers=comp, repeats=args.repeats, rows=rows,
        plain_loads_no_plugin=base["plugins"] == "none")  # fmt: skip


def report(out: dict[str, Any]) -> str:
    cols = [("case", "case", ""), ("seconds", "start s (median)", ".2f"), ("x_time", "x plain", ".2f"),
        ("rss_mib", "peak RSS MiB", ".0f"), ("x_rss", "x plain", ".2f"), ("devices", "devices", ""),
        ("plugins", "plugin modules imported", "")]  # fmt: skip
    where = out["machine"].get("cpu") or f"{os.cpu_count()} CPUs"
    return "\n".join(
        [
            f"MEASURED ({where}), {out['repeats']} fresh interpreters per case; "
            f"compilers in {out['compilers']}",
            table(out["rows"], cols),
            "plain CPU start loads no plugin: " + ("yes" if out["plain_loads_no_plugin"] else "NO"),
        ]
    )


def summary(out: dict[str, Any]) -> dict[str, Any]:
    return {"bench": "plan_startup", "plain_loads_no_plugin": out["plain_loads_no_plugin"],
        **{r["case"]: round(r["seconds"], 2) for r in out["rows"]}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    code, out = run_bench(bench, parse_args(argv), report, summary)
    if out is not None and not out["plain_loads_no_plugin"]:
        return 1
    return code

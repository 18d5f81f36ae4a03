"""One device check of both backends, inside a time budget: what runs on this machine's accelerator.

    scripts/device_check.sh [--cpu] [--out DIR] [--budget SECONDS] [--only STEP,...]

(the shell wrapper installs what the machine lacks and picks the interpreters). Steps, each in its
own process and time cap, the whole within ``--budget`` (a failed step is recorded, the next runs):
``env`` (versions, devices); ``copy-jax``/``copy-torch`` (copy rates, the baselines of swap and
update GB/s); ``swap-jax`` (the swap plan); ``rl-jax``/``rl-torch`` (3 RL steps; ``--cpu``: 2, then
``--resume`` for a third; a checkpoint at steps 1 and 2; the allocator against the run's memory plan;
a step's non-rollout, non-train share as ``python -m mllm_rl.bench step-cost`` reads it); ``engine-torch``/``engine-jax``
(decode tokens/s against HF ``generate``, ops per decode step); GPU only, ``tests-cuda`` (the CUDA
tests of the torch attention paths and memory probe). GPU: ``qwen3-0.6b`` (random bf16 weights); ``--cpu``: ``tiny``,
the same steps but ``tests-cuda`` (the test suite runs it). ``device_check.json``/``.md`` and each step's log
go to ``--out`` (default ``$OUT``, else ``runs/device-check``), rewritten after every step.
Exit 0 when every step that ran passed, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

RESERVE_S = 15.0  # kept back at the end to write the results


def failure_line(text: str) -> str:
    """What a failed step's output says of why: a run's ``error:`` line, else its last three
    lines, without the lines XLA's CUDA client repeats after a fault (``NOISE``)."""
    from mllm_rl.bench.child import NOISE  # here: --help runs before the project is installed

    lines = [ln for ln in text.splitlines() if ln.strip() and not any(n in ln for n in NOISE)]
    said = [ln for ln in lines if ln.startswith("error: ")][-1:]
    return " | ".join(said or lines[-3:])[-400:]


def _step_table(mode: str, engine_batch: str = "") -> list[dict[str, Any]]:
    """name, backend (which interpreter), time cap (s) and the command after the interpreter."""
    gpu = mode == "gpu"
    model = "qwen3-0.6b" if gpu else "tiny"
    jplat, tplat = ("gpu", "cuda") if gpu else ("cpu", "cpu")
    common = ["--model", model, "--wandb", "disabled"]
    # steps 1 and 2 save (every 2 steps and the last): a step's non-rollout, non-train share at
    # the run's default checkpoint cadence (``_step_share``)
    rl = ["--steps", "3" if gpu else "2", "--prompts-per-step", "8", "--group-size", "4",
          "--max-new-tokens", "64" if gpu else "16", "--checkpoint-every", "2"]  # fmt: skip
    batches = engine_batch or ("1,32,128" if gpu else "4")
    engine = ["--preset", model, "--batch", batches, "--new-tokens", "64" if gpu else "16", "--repeats",
              "2" if gpu else "1", "--rounds", "1", "--keep-going", "--timeout", "140" if gpu else "120"]  # fmt: skip
    return [
        {"name": "env", "backend": "jax", "cap": 60, "argv": ["-c", ENV_PROBE]},
        {"name": "copy-jax", "backend": "jax", "cap": 45,
         "argv": ["-m", "mllm_rl.bench", "copy", "--backend", "jax", "--platform", jplat, "--mb", "1024" if gpu else "64"]},
        {"name": "swap-jax", "backend": "jax", "cap": 120, "run": True,
         "argv": ["-m", "mllm_rl.run", "--backend", "jax", "--platform", jplat, "--plan", "swap", *common]},
        {"name": "rl-jax", "backend": "jax", "cap": 200, "run": True, "resume_to": None if gpu else 3,
         "argv": ["-m", "mllm_rl.run", "--backend", "jax", "--platform", jplat, *common, *rl]},
        {"name": "copy-torch", "backend": "torch", "cap": 45,
         "argv": ["-m", "mllm_rl.bench", "copy", "--backend", "torch", "--platform", tplat, "--mb", "1024" if gpu else "64"]},
        {"name": "rl-torch", "backend": "torch", "cap": 150, "run": True,
         "argv": ["-m", "mllm_rl.run", "--backend", "torch", "--platform", tplat, *common, *rl]},
        {"name": "engine-torch", "backend": "torch", "cap": 150, "bench": True,
         "argv": ["-m", "mllm_rl.bench", "engine", "--engines", "embedded,hf", "--platform", tplat, *engine]},
        {"name": "engine-jax", "backend": "jax", "cap": 120, "bench": True,
         "argv": ["-m", "mllm_rl.bench", "engine", "--engines", "sglang-jax", "--platform", jplat, *engine]},
    ] + ([{"name": "tests-cuda", "backend": "torch", "cap": 60,  # the CUDA-only tests of the attention paths and probe
           "argv": ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/torch/test_attention.py", "tests/torch/test_probe.py", "-k", "cuda"]}]
         if gpu else [])  # fmt: skip


ENV_PROBE = r"""
import json, importlib.metadata as md, platform, sys
out = {"python": sys.version.split()[0], "machine": platform.machine(), "packages": {}}
for p in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "sglang-jax", "transformers", "numpy", "torch",
          "torch-memory-saver", "math-verify", "jax-cuda13-plugin", "jax-cuda12-plugin"):
    try:
        out["packages"][p] = md.version(p)
    except md.PackageNotFoundError:
        pass
import jax
out["jax_devices"] = [f"{d.platform}:{d.id} {d.device_kind}" for d in jax.devices()]
from mllm_rl.backends.jax.engine_layout import attention_backend
d = jax.devices()[0]
out["sglang_jax_attention_backend"] = attention_backend(d.platform, d.device_kind)
print(json.dumps(out))
"""


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            with contextlib.suppress(ValueError):
                return json.loads(line)
    return None


def _run(argv: list[str], timeout: float, log: Path, env: dict[str, str]) -> tuple[int, float, str]:
    """Run in its own process group; on time-out SIGTERM the group, then SIGKILL after 10 s.
    Returns (exit code, 124 when timed out; seconds; output)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(argv) + "\n")
        f.flush()
        p = subprocess.Popen(
            argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            rc = p.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                    os.killpg(p.pid, sig)
                    p.wait(timeout=10)
                    break
            rc = 124
    return rc, time.perf_counter() - t0, log.read_text(errors="replace")


def _dev_peak(rec: dict[str, Any]) -> tuple[int | None, int | None, str | None]:
    """(the phase's peak, the bytes in use at its end, their source) on the fullest device: the
    torch allocator's entries where there are any (CUDA's device truth also counts the context and
    cached free blocks, which a plan does not), else each device's first entry."""
    from mllm_rl.bench.records import allocator, truth

    devs = rec.get("memory", {}).get("devices", [])
    use = allocator(devs) or truth(devs)
    peaks = [d["phase_peak_bytes"] for d in use if d.get("phase_peak_bytes") is not None]
    ends = [d["bytes_in_use"] for d in use if d.get("bytes_in_use") is not None]
    return (max(peaks) if peaks else None), (max(ends) if ends else None), (use[0]["source"] if use else None)


def summarize_run(run_dir: Path) -> dict[str, Any]:
    """What a run directory shows: phases of the last step and of the last attempt's setup (a resumed
    run's directory holds every attempt) (seconds, allocator end and peak, the plan's end and peak
    prediction), swap/update GB/s, the plan audit's verdict."""
    from mllm_rl.memplan.audit import compare, drifts, load_records, summary

    recs = load_records(run_dir) if (run_dir / "phases.jsonl").is_file() else []
    out: dict[str, Any] = {"records": len(recs)}
    if not recs:
        return out
    steps = sorted({r["step"] for r in recs if r.get("step") is not None})
    last = steps[-1] if steps else None
    out["steps"] = len(steps)
    plan_path = run_dir / "plan.json"
    plan_doc = json.loads(plan_path.read_text()) if plan_path.is_file() else None
    plan_phases: dict[str, dict[str, Any]] = {}
    if plan_doc:
        plan = plan_doc["plans"][plan_doc["schedule"]]
        out["plan_target"] = plan.get("target", {}).get("name")
        for p in plan["phases"]:
            plan_phases.setdefault(p["phase"], p)
    starts = [i for i, r in enumerate(recs) if r["phase"] == "wandb_init"]
    rows = []
    for r in recs[starts[-1] if starts else 0 :]:
        if r.get("step") not in (None, last):
            continue
        peak, end, src = _dev_peak(r)
        key = r["phase"] if r.get("step") is not None else "setup:" + r["phase"]
        pp = plan_phases.get(key)
        row = {"phase": key, "seconds": round(r["t_end"] - r["t_start"], 4), "source": src,
               "end_bytes": end, "peak_bytes": peak, "plan_peak_bytes": pp["total"] if pp else None}  # fmt: skip
        if pp and peak:
            row["peak_over_plan"] = round(peak / pp["total"], 4) if pp["total"] else None
        row.update({k: r["info"][k] for k in ("gbps", "bytes", "tensors", "compiles", "compile_s") if k in r.get("info", {})})  # fmt: skip
        if r.get("info", {}).get("error"):
            row["error"] = str(r["info"]["error"])[:300]
        rows.append(row)
    out["phases"] = rows
    for name in ("weights_swapped", "update_weights"):
        got = [r for r in rows if r["phase"].removeprefix("setup:") == name and "gbps" in r]
        if got:
            out.update({f"{name}_{k}": got[-1].get(k) for k in ("gbps", "bytes", "seconds", "compile_s")})
    if plan_doc:
        try:
            check = compare([r for r in recs if r.get("process_index", 0) == 0], plan_doc)
            out["plan_audit"] = summary(check)
            out["plan_drifts"] = [r["phase"] for r in drifts(check)]
        except (ValueError, KeyError, TypeError) as e:
            out["plan_audit"] = f"not compared: {e}"
    out.update(_step_share(run_dir, recs))
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        last = ([json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] or [{}])[-1]
        out["metrics_last"] = {k: v for k, v in last.items() if isinstance(v, (int, float))}
    return out


def _step_share(run_dir: Path, recs: list[dict[str, Any]]) -> dict[str, Any]:
    """An RL run's non-rollout, non-train share of a step as ``python -m mllm_rl.bench step-cost``
    reads it (median over the steps after each attempt's first; at the run's default checkpoint
    cadence when its counted steps saved); nothing for a run without such a step."""
    from mllm_rl.bench.step_cost import RUN_CADENCE, analyse

    meta = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").is_file() else {}
    if not isinstance(meta.get("expected_step_phases"), list):
        return {}
    try:
        a = analyse(recs, meta["expected_step_phases"], cadence=RUN_CADENCE)
    except ValueError:
        return {}
    keys = ("step_s_median", "other_share_median", "other_share_at_cadence", "cadence", "steps_counted")
    return {k: a[k] for k in keys}


def _md(doc: dict[str, Any]) -> str:
    """The markdown report: one line per step, then each run's phase table."""
    from mllm_rl.summary import gib as g

    # a copied tree whose git metadata is older than its files shows as a commit with changes
    dirty = " with changes to its files" if ((doc.get("machine") or {}).get("git") or {}).get("dirty") else ""
    lines = [f"# Device check ({doc['mode']}): {doc.get('device') or 'no accelerator'}", "",
             f"commit {doc.get('commit')}{dirty}, {doc['date']}; every figure MEASURED on this machine.", "",
             "| step | exit | seconds | result |", "|---|---|---|---|"]  # fmt: skip
    for s in doc["steps"]:
        lines.append(f"| {s['name']} | {s['rc']} | {s['seconds']:.1f} | {s.get('headline', '')} |")
    for s in doc["steps"]:
        res = s.get("result") or {}
        if not res.get("phases"):
            continue
        lines += ["", f"## {s['name']}: phases of the last step (bytes: {res['phases'][-1].get('source')})", "",
                  "| phase | s | compile s (summed) | end GiB | peak GiB | plan peak GiB | peak/plan | GB/s |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in res["phases"]:
            lines.append(
                f"| {r['phase']} | {r['seconds']:.3f} | {r.get('compile_s', '-')} | {g(r['end_bytes'])} | {g(r['peak_bytes'])} | "
                f"{g(r.get('plan_peak_bytes'))} | {r.get('peak_over_plan', '-')} | {r.get('gbps', '-')} |"
            )
        if res.get("plan_audit"):
            lines += ["", res["plan_audit"]]
    return "\n".join(lines) + "\n"


def _headline(step: dict[str, Any], doc: dict[str, Any]) -> str:
    res = step.get("result") or {}
    name = step["name"]
    if step["rc"] != 0:
        return f"FAILED: {step.get('error', '')}"[:400]
    if name == "env":
        return f"jax {res.get('packages', {}).get('jax')}, devices {res.get('jax_devices')}"
    if name.startswith("copy-"):
        return ", ".join(f"{k.removesuffix('_gbps')} {v} GB/s" for k, v in _copy_rates(res).items())
    if name.startswith(("swap-", "rl-")):
        bits = [f"{res.get('steps', 0)} steps, {res.get('records', 0)} records"]
        base = doc["copy"].get(name.split("-", 1)[1]) or {}
        for k in ("weights_swapped", "update_weights"):
            if res.get(f"{k}_gbps") is not None:
                gbps = res[f"{k}_gbps"]
                ratios = [
                    f"{gbps / base[b]:.3f}x {b[:3].upper()}" for b in ("h2d_gbps", "d2d_gbps") if base.get(b)
                ]
                if res.get(f"{k}_compile_s"):  # XLA compiles in the phase (JAX), summed over threads
                    ratios.append(f"in {res.get(f'{k}_seconds')} s: {res[f'{k}_compile_s']} s of compiles")
                bits.append(f"{k} {gbps} GB/s" + (f" ({', '.join(ratios)})" if ratios else ""))
        if res.get("other_share_median") is not None:
            at = res.get("other_share_at_cadence")
            bits.append(f"non-rollout, non-train {res['other_share_median']:.1%} of a {res['step_s_median']:.2f} s step"
                        + (f" ({at:.1%} at a checkpoint every {res['cadence']} steps)" if at is not None else ""))  # fmt: skip
        if res.get("plan_audit"):
            bits.append(res["plan_audit"])
        return "; ".join(bits)
    if name.startswith("tests-"):
        return res.get("summary", "")
    if name.startswith("engine-"):  # decode tok/s, over HF's in the same run, ops per decode step
        return "; ".join(
            f"{r['engine']} B={r['batch']}: {r.get('decode_tok_s')} tok/s"
            + (f" ({r['decode_over_hf']}x HF)" if r.get("decode_over_hf") and r["engine"] != "hf" else "")
            + (f", {r['ops_per_step']:.0f} ops/step" if r.get("ops_per_step") else "")
            for r in res.get("rows") or []
        )
    return ""


def _copy_rates(res: dict[str, Any]) -> dict[str, Any]:
    """The copy bench's best rates (``h2d_gbps``, ``d2h_gbps``, ``d2d_gbps``) from its JSON."""
    return {f"{k}_gbps": v["gbps_best"] for k, v in res.items() if isinstance(v, dict) and "gbps_best" in v}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--cpu", action="store_true", help="the same steps on the tiny model, JAX/torch on CPU")
    ap.add_argument("--out", type=Path, help="results directory (default: $OUT, else runs/device-check)")
    ap.add_argument("--budget", type=float, default=540.0, help="seconds for the whole check (default 540)")
    ap.add_argument(
        "--engine-batch", default="", help="engine steps' batch sizes (default 1,32,128; --cpu 4)"
    )
    ap.add_argument("--only", default="", help="comma-separated step names or prefixes")
    ap.add_argument("--python-jax", default=sys.executable, help="interpreter of the jax steps")
    ap.add_argument("--python-torch", default=sys.executable, help="interpreter of the torch steps")
    args = ap.parse_args(argv)
    if args.budget <= RESERVE_S:
        ap.error(f"--budget {args.budget}: must exceed {RESERVE_S} s")
    deadline = time.monotonic() + args.budget - RESERVE_S
    mode = "cpu" if args.cpu else "gpu"
    out = args.out or Path(os.environ.get("OUT") or ROOT / "runs" / "device-check")
    steps = _step_table(mode, args.engine_batch)
    only = [s for s in args.only.split(",") if s]
    if only:
        steps = [s for s in steps if any(s["name"].startswith(o) for o in only)]
        if not steps:
            names = ", ".join(s["name"] for s in _step_table(mode))
            ap.error(f"--only {args.only}: selects no step ({names})")
    out.mkdir(parents=True, exist_ok=True)
    from mllm_rl.bench.child import child_env
    from mllm_rl.bench.machine import machine_info

    info = machine_info()
    doc: dict[str, Any] = {"schema": "mllm_rl.device_check/1", "mode": mode, "budget_s": args.budget,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": (info.get("git") or {}).get("commit"),
                           "device": ", ".join(info.get("gpus") or []) or None, "machine": info, "copy": {}, "steps": []}  # fmt: skip
    env = child_env()  # JAX's compilation cache off unless set: each step compiles as on a fresh machine
    if args.cpu:
        env["JAX_PLATFORMS"] = "cpu"
    runs = out / "runs"

    def save() -> None:
        (out / "device_check.json").write_text(json.dumps(doc, indent=1, default=str))
        (out / "device_check.md").write_text(_md(doc))

    for spec in steps:
        left = deadline - time.monotonic()
        name = spec["name"]
        py = args.python_jax if spec["backend"] == "jax" else args.python_torch
        step: dict[str, Any] = {"name": name, "rc": None, "seconds": 0.0}
        if left < 20:
            step.update(rc=-1, error=f"skipped: {left:.0f} s of the budget left")
            doc["steps"].append(step)
            save()
            continue
        cmd = [py, *spec["argv"]]
        run_dir = runs / name
        if spec.get("run"):
            cmd += ["--run-dir", str(run_dir)]
        if spec.get("bench"):
            jax = ["--python-jax", args.python_jax] if spec["backend"] == "jax" else []
            cmd += ["--json", str(out / f"{name}.json"), *jax, "--python-torch", args.python_torch]
        step["cmd"] = " ".join(a if "\n" not in a else "<probe>" for a in cmd)
        print(f"== {name} (at most {min(spec['cap'], left):.0f} s): {step['cmd']}", flush=True)
        rc, secs, text = _run(cmd, min(spec["cap"], left), out / f"{name}.log", env)
        if rc == 0 and spec.get("resume_to"):
            rcmd = [py, "-m", "mllm_rl.run", "--backend", spec["backend"], "--run-dir", str(run_dir), "--resume",
                    "--steps", str(spec["resume_to"]), "--wandb", "disabled"]  # fmt: skip
            step["resume_cmd"] = " ".join(rcmd)
            rc, s2, t2 = _run(rcmd, max(deadline - time.monotonic(), 1), out / f"{name}-resume.log", env)
            secs, text = secs + s2, text + t2
        step.update(rc=rc, seconds=round(secs, 2))
        try:
            if spec.get("run"):
                step["result"] = summarize_run(run_dir)
            elif spec.get("bench"):
                p = out / f"{name}.json"
                step["result"] = json.loads(p.read_text()) if p.is_file() else None
                engines = (step["result"] or {}).get("engines", {}).values()
                errs = [e["error"] for e in engines if e.get("error")]
                if errs and rc == 0:  # --keep-going reports a failed engine and exits 0
                    rc = step["rc"] = 1
                    step["error"] = errs[0].splitlines()[0][:300] + " ... " + errs[0].splitlines()[-1][:300]
            elif name.startswith("tests-"):  # pytest's summary line
                step["result"] = {"summary": ([ln for ln in text.splitlines() if ln.strip()] or [""])[-1]}
            else:
                step["result"] = _last_json(text)
        except Exception as e:  # a result that cannot be read is the step's failure, not the check's
            step["result"] = None
            step["error"] = f"result not read: {e}"
            rc = step["rc"] = step["rc"] or 1
        if name.startswith("copy-") and step["result"]:
            doc["copy"][name.split("-", 1)[1]] = _copy_rates(step["result"])
        if rc != 0:
            step.setdefault("error", "timed out" if rc == 124 else failure_line(text))
        step["headline"] = _headline(step, doc)
        print(f"   exit {rc} in {secs:.1f} s: {step['headline']}", flush=True)
        doc["steps"].append(step)
        save()
    failed = sum(s["rc"] != 0 for s in doc["steps"])
    print(f"results: {out / 'device_check.md'} ({failed} step(s) failed or skipped)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

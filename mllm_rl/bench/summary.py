"""Summary table of a directory of benchmark JSON files (what ``scripts/gpu_bench_all.sh`` prints last).

    python -m mllm_rl.bench summary DIR [--markdown OUT.md]

Reads every ``DIR/*.json`` written by the benchmarks ``swap``/``release``/``rl-memory``/``soak``/
``engine``/``plan vs-cuda`` (``--json``) and ``DIR/status.tsv`` (``name<TAB>exit code<TAB>seconds``,
one line per step of ``gpu_bench_all.sh``), and prints one markdown row per result: the
headline figures and every target's verdict. Steps that failed without JSON are listed too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mllm_rl.bench import GiB, MiB
from mllm_rl.bench.tables import VERDICT


def _r(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def figures(d: dict[str, Any]) -> str:
    b = d.get("bench")
    if b == "swap":
        parts = [f"{r['mode']}: peak/steady {_r(r['peak_over_steady'])}, weights-only {_r(r['weights_only_ratio'])}, "
                 f"{_r(r['gbps'])} GB/s ({_r(r['gbps_over_h2d'])} of H2D)" for r in d["rows"]]  # fmt: skip
        if base := d.get("copy_baseline") or {}:
            pin = base.get("h2d_pinned", {}).get("gbps_best")
            parts.append(f"H2D {_r(base['h2d']['gbps_best'])} GB/s" + (f", pinned {_r(pin)}" if pin else ""))
        return "; ".join(parts)
    if b == "release":
        parts = [f"{t}: freed {_r(v['freed_frac'], 4)}, release {_r(v['release_s'] * 1e3, 2)} ms "
                 f"({_r(v['release_over_memcpy'])}x {v['release_baseline']}), resume {_r(v['resume_s'] * 1e3, 2)} ms "
                 f"({_r(v['resume_over_memcpy'])}x {v['resume_baseline']})" for t, v in d["tags"].items()]  # fmt: skip
        return f"cpu backup {d['weights_cpu_backup']}; " + "; ".join(parts)
    if b == "rl_memory":
        parts = []
        for s, e in d["schedules"].items():
            fit = e.get("bisect", {}).get("largest_ok_tokens") if e.get("bisect") else None
            fit_txt = (f"bisected max KV {fit} tok" if fit is not None else
                       f"predicted max KV {(e.get('fit_run') or {}).get('tokens')} tok (run), "
                       f"{(e.get('fit_steps') or {}).get('tokens')} (steps)")  # fmt: skip
            parts.append(f"{s}: step peak {_r((e['step_peak'] or 0) / MiB, 1)} MiB at {e['step_peak_phase']}, "
                         f"/max(train,rollout) {_r(e['step_peak_over_max_train_rollout'])}, {fit_txt}")  # fmt: skip
        parts.append(f"naive/multi_stage {_r(d.get('naive_over_multi_stage_step_peak'))}")
        return "; ".join(parts)
    if b == "soak":
        return (
            f"{d['cycles']} cycles ({d['engine']}{', trainer' if d['trainer'] else ''}, backup "
            f"{d['weights_cpu_backup']}): device max dev {d['device_max_abs_dev_bytes']} B, RSS max dev "
            f"{_r(d['rss_max_abs_dev_bytes'] / MiB, 2)} MiB, greedy identical "
            f"{d['cycles'] - d.get('token_mismatch_count', len(d['token_mismatch_cycles']))}/{d['cycles']}"
        )
    if b == "engine":
        return "; ".join(f"{r['engine']} B={r['batch']}: {_r(r['decode_tok_s'], 1)} tok/s ({_r(r['decode_over_hf'])}x hf)"
                         + (f" [{r['over_length_outputs']} outputs longer than asked]" if r.get("over_length_outputs") else "")
                         for r in d["rows"])  # fmt: skip
    if b == "plan_vs_cuda":
        c, m = d["predicted"]["case"], d.get("measured") or {}
        opts = " ".join(f"{k}={v}" for k, v in c["options"]) or "defaults"
        what = f"{c['rows']} x {c['seq_len']} {c['precision']}, lora {c['lora_rank']}, {opts}: "
        pred = _r(d["predicted"]["peak_bytes"] / GiB, 2)
        if not m:
            return what + f"predicted peak {pred} GiB (not measured)"
        return what + f"peak {_r(m['peak_bytes'] / GiB, 2)} GiB measured / {pred} predicted = {_r(d['peak_over_plan'], 4)}" + (
            ", OUT OF MEMORY" if m.get("oom") else f", {_r(m.get('tokens_per_s'), 0)} tokens/s")  # fmt: skip
    return "(unknown bench)"


def targets(d: dict[str, Any]) -> str:
    t = d.get("targets") or {}
    return ", ".join(f"{k} {VERDICT[v['pass']]}" for k, v in t.items()) or "-"


def summarize(root: Path) -> str:
    rows = [
        "| result | bench | backend | preset | platform | figures | targets |",
        "|---|---|---|---|---|---|---|",
    ]
    seen = set()
    for f in sorted(root.glob("*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            rows.append(f"| {f.stem} | ? | | | | unreadable: {e} | |")
            continue
        if not isinstance(d, dict) or "bench" not in d:
            continue
        seen.add(f.stem)
        platform = d.get("platform") or (d.get("rows") or [{}])[0].get("platform")
        rows.append(f"| {f.stem} | {d['bench']} | {d.get('backend', '-')} | {d.get('preset', '-')} | "
                    f"{platform or '-'} | {figures(d)} | {targets(d)} |")  # fmt: skip
    status = root / "status.tsv"
    if status.exists():
        for line in status.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 2 and parts[1] != "0":
                note = "no JSON" if parts[0] not in seen else "JSON written, exit non-zero"
                rows.append(
                    f"| {parts[0]} | | | | | step exited {parts[1]} ({note}; see {parts[0]}.log) | FAIL |"
                )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--markdown", type=Path, help="also write the table here")
    args = ap.parse_args(argv)
    if not args.dir.is_dir():
        print(f"error: {args.dir}: not a directory", file=sys.stderr)
        return 2
    text = summarize(args.dir)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0

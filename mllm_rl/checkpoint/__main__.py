"""``python -m mllm_rl.checkpoint {make,check}``: write or validate a checkpoint."""

from __future__ import annotations

import argparse
import sys
import time

from mllm_rl.checkpoint.make import make_checkpoint
from mllm_rl.checkpoint.model_dir import CheckpointError, ModelDir
from mllm_rl.presets import PRESETS, get_preset


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mllm_rl.checkpoint", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make", help="write a random-weight HF checkpoint from a preset")
    mk.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    mk.add_argument("--out", required=True, help="output directory")
    mk.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the preset's")
    mk.add_argument("--seed", type=int, default=0)
    mk.add_argument("--shard-mb", type=float, default=2048.0, help="max shard size in MiB (default 2048)")
    mk.add_argument(
        "--force",
        action="store_true",
        help="replace a different checkpoint already in --out (without it: refused, unless it holds the "
        "same preset, dtype and seed)",
    )
    ck = sub.add_parser(
        "check", help="validate a checkpoint directory (config, shards, tensors, tokenizer, finite values)"
    )
    ck.add_argument("path")
    ck.add_argument("--skip-values", action="store_true", help="do not scan the weights for NaN/inf")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "make":
            cfg = get_preset(args.preset)
            out = make_checkpoint(
                cfg,
                args.out,
                dtype=args.dtype,
                seed=args.seed,
                shard_bytes=int(args.shard_mb * 2**20),
                force=args.force,
            )
            md = ModelDir.open(out, check_values=False)  # values just drawn: finite by construction
            print(f"wrote {out} ({cfg.num_params() / 1e6:.1f}M params, {md.nbytes / 2**30:.3f} GiB)")
        else:
            md = ModelDir.open(args.path, check_values=False)
            t0 = time.perf_counter()
            if not args.skip_values:
                md.check_values()
            values = "not scanned" if args.skip_values else f"all finite ({time.perf_counter() - t0:.2f} s)"
            print(
                f"ok {md.path}: {len(md.tensors)} tensors, {md.nbytes / 2**30:.3f} GiB, "
                f"{md.config.name}; values {values}"
            )
    except (CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

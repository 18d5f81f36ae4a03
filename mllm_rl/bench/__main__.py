"""``python -m mllm_rl.bench copy --backend jax|torch ...``: the copy-bandwidth baselines
(``mllm_rl.bench.copy_bandwidth``), one JSON line."""

from __future__ import annotations

import sys

from mllm_rl.bench.copy_bandwidth import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m mllm_rl.bench"))

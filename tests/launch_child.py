"""A stand-in for ``python -m mllm_rl.run`` under ``python -m mllm_rl.launch --module tests.launch_child``
(the launcher's own tests: what it passes each process and how it stops them).

``ok``: print this process's rank variables and exit 0. ``fail RANK CODE PIDDIR``: the process of
rank RANK exits CODE after the others wrote their pid into PIDDIR; the others wait forever.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

rank = int(os.environ["MLLM_RL_PROCESS_ID"])
if sys.argv[1] == "ok":
    keys = ("MLLM_RL_NUM_PROCESSES", "MLLM_RL_COORDINATOR", "RANK", "WORLD_SIZE", "MASTER_PORT")
    print(" ".join(f"{k}={os.environ[k]}" for k in keys))
    print(f"stderr of {rank}", file=sys.stderr)
    sys.exit(0)
bad, code, piddir = int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
n = int(os.environ["MLLM_RL_NUM_PROCESSES"])
if rank == bad:
    deadline = time.time() + 60
    while len(list(piddir.glob("*.pid"))) < n - 1 and time.time() < deadline:
        time.sleep(0.05)
    sys.exit(code)
(piddir / f"{rank}.pid").write_text(str(os.getpid()))
while True:
    time.sleep(1)

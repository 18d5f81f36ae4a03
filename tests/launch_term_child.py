"""Two processes of a torch gloo group under ``python -m mllm_rl.launch --module
tests.launch_term_child -- PIDDIR``, stopped by SIGTERM where a run's processes deadlock: process
1 inside a collective (a C call: the ``Terminated`` that SIGTERM raises waits for it to return)
that process 0 never joins; process 0 in Python, its ``finally`` waiting in a barrier (as a run's
``shutdown_distributed`` does) for process 1, which never gets there. Each writes its pid into
PIDDIR once it is in place."""

from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

from mllm_rl.signals import install_sigterm

install_sigterm()  # as python -m mllm_rl.run does, before any thread exists

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

rank = int(os.environ["RANK"])
dist.init_process_group(
    "gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=300)
)
pid_file = Path(sys.argv[1]) / f"{rank}.pid"
try:
    if rank == 1:
        pid_file.write_text(str(os.getpid()))
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(torch.zeros(2), torch.ones(1))  # never returns: process 0 does not join
    else:
        pid_file.write_text(str(os.getpid()))
        while True:
            time.sleep(0.1)
finally:
    dist.barrier()
    dist.destroy_process_group()

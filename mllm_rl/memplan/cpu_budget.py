"""What a run on the CPU may plan for its devices: the RAM the host can give, not all of it.

On JAX CPU and torch CPU the "device" is host memory, shared with this process, its host copies
(offloaded state, weight backups), the compilers' working memory and every other process. Planning
against the host's total RAM would size a ``--kv-tokens auto`` pool that the kernel kills. The
budget is ``CPU_SHARE`` of what ``psutil`` says is available when the plan is made (free plus
reclaimable pages: what other processes leave), and the target's ``source`` says so.
"""

from __future__ import annotations

CPU_SHARE = 0.5


def cpu_device_bytes() -> tuple[int, str, int]:
    """``(bytes the CPU devices may take, where that figure comes from, the host's total RAM)``."""
    import psutil

    vm = psutil.virtual_memory()
    budget = int(vm.available * CPU_SHARE)
    source = (
        f"host RAM: {CPU_SHARE:g} x the {vm.available} B available when planned (psutil; "
        f"{vm.total} B in all): the rest holds the run's process, host copies, compilers and other work"
    )
    return budget, source, int(vm.total)

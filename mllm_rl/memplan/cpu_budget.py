"""What a CPU target's devices may take: ``CPU_SHARE`` of the RAM available when planned, not the
host's total (shared with this process, its host copies, the compilers and other processes: a
``--kv-tokens auto`` pool sized to all of it would be killed)."""

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

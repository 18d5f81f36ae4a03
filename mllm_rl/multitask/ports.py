"""One port allocator for every task's engine in a run.

Server engines bind TCP ports (SGLang's HTTP/scheduler ports and ``nccl_port``, sglang-jax's
multi-node broadcast at ``dist_init_addr`` port+5/+6); two engines started together pick ports by
"random + is it free?" and can collide, killing the second. So each task gets its own block of
consecutive ports, checked free by binding each, none handed out twice. In a multi-process run
process 0 allocates and shares the blocks (``Coordinator.gather``)."""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

BLOCK = 8  # ports per task: sglang-jax multi-node binds base+5 and base+6; SGLang port + nccl_port
FIRST_PORT = 20000
LAST_PORT = 60000


def port_free(port: int, host: str = "0.0.0.0") -> bool:
    """Can a TCP socket bind ``port`` now (the bind test)?"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class PortAllocator:
    """Hands out blocks of ``BLOCK`` consecutive free ports, each port at most once."""

    def __init__(
        self, first: int = FIRST_PORT, last: int = LAST_PORT, is_free: Callable[[int], bool] = port_free
    ) -> None:
        if not 0 < first < last < 65536:
            raise ValueError(f"port range {first}-{last} is not within 1-65535")
        self.next, self.last, self.is_free = first, last, is_free
        self.given: dict[str, list[int]] = {}

    def block(self, owner: str, n: int = BLOCK) -> list[int]:
        """``n`` consecutive ports, every one bind-tested free and never given before."""
        if owner in self.given:
            raise ValueError(f"ports for {owner!r} were already allocated: {self.given[owner]}")
        taken = {p for ports in self.given.values() for p in ports}
        base = self.next
        while base + n - 1 <= self.last:
            ports = list(range(base, base + n))
            busy = next((p for p in ports if p in taken or not self.is_free(p)), None)
            if busy is None:
                self.given[owner] = ports
                self.next = base + n
                return ports
            base = busy + 1
        raise RuntimeError(f"no {n} consecutive free ports left in {self.next}-{self.last} for {owner!r}")


def allocate(owners: Sequence[str], allocator: PortAllocator | None = None) -> dict[str, list[int]]:
    """A block of ports per owner (task name), from one allocator."""
    alloc = allocator or PortAllocator()
    return {name: alloc.block(name) for name in owners}

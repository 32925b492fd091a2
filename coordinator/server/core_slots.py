"""Which cores each worker rank on this node runs on: the CPUs this process may use (its affinity,
under a cgroup's CPU quota) split evenly among the node's ranks, each pinned to its own, so ranks
never share a core and torch runs one thread per core of its group. A rank's group is taken back
when it goes and given to its replacement."""

from __future__ import annotations

import math
import os
from pathlib import Path


def usable_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        cpus = sorted(os.sched_getaffinity(0))
    else:
        cpus = list(range(os.cpu_count() or 1))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = cpus[: max(1, math.ceil(int(quota) / int(period)))]
    except (OSError, ValueError):
        pass
    return cpus


class CoreSlots:
    def __init__(self, ranks: int, threads: int = 0):
        """``threads``: per rank (0: the usable CPUs over ``ranks``, at least one)."""
        cpus = usable_cpus()
        self.threads = threads or max(1, len(cpus) // max(ranks, 1))
        groups = len(cpus) // self.threads
        self._groups = [cpus[i * self.threads : (i + 1) * self.threads] for i in range(groups)]
        self._free = list(range(groups - 1, -1, -1))

    def take(self) -> tuple[int | None, list[int]]:
        """A group's index and cores; (None, []) when every group is taken: the rank runs unpinned."""
        if not self._free:
            return None, []
        slot = self._free.pop()
        return slot, self._groups[slot]

    def give(self, slot: int | None) -> None:
        if slot is not None:
            self._free.append(slot)

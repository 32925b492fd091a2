"""Which LoRA adapter sits in which of a worker's slots, as the coordinator keeps it.

The worker holds ``max_loras`` adapter slots in its device pool; this is their map. A launch's
adapters are each given a slot: one already holding it, else a free one, else the least recently
used one that no running request needs (the scheduler admits at most ``max_loras`` adapters among
the running requests, so there always is one). What must be read into a slot rides in the launch's
descriptor (``lora_loads``), and the worker reads it before the launch runs: launches run in
order, so a slot is never overwritten under a launch still using it.
"""

from __future__ import annotations

from collections import OrderedDict

from fusedserve.coordinator.engine.scheduled_batch import ScheduledBatch
from fusedserve.coordinator.engine.sequence import Sequence


class LoraSlots:
    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.resident: OrderedDict[str, int] = OrderedDict()  # adapter key -> slot, least recent first
        self.loads = 0  # adapters read into a slot (stats)

    def assign(self, batch: ScheduledBatch, running: list[Sequence]) -> tuple[list[int] | None, list[list]]:
        """Each row's slot (None: no row has an adapter) and the loads this launch needs, as
        ``[slot, key, path]``."""
        used = {seq.lora.key: seq.lora for seq in batch.seqs if seq.lora is not None}
        if not used:
            return None, []
        needed = set(used) | {s.lora.key for s in running if s.lora is not None}
        loads = []
        for key, served in used.items():
            if key in self.resident:
                self.resident.move_to_end(key)
                continue
            slot = self._free_slot(needed)
            self.resident[key] = slot
            loads.append([slot, key, served.adapter.path])
            self.loads += 1
        return [-1 if s.lora is None else self.resident[s.lora.key] for s in batch.seqs], loads

    def _free_slot(self, needed: set[str]) -> int:
        taken = set(self.resident.values())
        for slot in range(self.max_loras):
            if slot not in taken:
                return slot
        for key, slot in self.resident.items():  # least recently used first
            if key not in needed:
                del self.resident[key]
                return slot
        raise RuntimeError(f"every one of the {self.max_loras} LoRA slots holds an adapter a running request "
                           "needs (the scheduler admits no more adapters than slots)")

    def holds(self, key: str) -> bool:
        """Whether the worker has ``key`` in a slot (the router prefers such a worker)."""
        return key in self.resident

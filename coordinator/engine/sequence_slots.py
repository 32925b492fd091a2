"""Which row of a worker's per-request device state each request holds: its token counts
(``kernels/penalties.py``: penalized requests) or a hybrid model's recurrent states
(``kernels/hybrid_cache.py``: every request). Given when it first runs, taken back once it no
longer runs. A request that comes back (preempted, or moved from a lost worker) recomputes from
its first chunk, which resets and rebuilds its state, so a slot never has to outlive a stay in the
running batch."""

from __future__ import annotations

from collections.abc import Callable

from fusedserve.coordinator.engine.scheduled_batch import ScheduledBatch
from fusedserve.coordinator.engine.sequence import Sequence


class SequenceSlots:
    def __init__(self, slots: int, holds: Callable[[Sequence], bool]):
        """``holds``: whether a request holds a slot (penalized ones; every one for states)."""
        self._free = list(range(slots - 1, -1, -1))
        self._held: dict[str, int] = {}
        self._holds = holds

    def assign(self, batch: ScheduledBatch, running: list[Sequence]) -> dict[int, int]:
        """Row -> slot for the batch's rows that hold one (at most one slot per running request)."""
        live = {s.seq_id for s in running}
        for seq_id in [k for k in self._held if k not in live]:
            self._free.append(self._held.pop(seq_id))
        rows = {}
        for row, seq in enumerate(batch.seqs):
            if self._holds(seq):
                if seq.seq_id not in self._held:
                    self._held[seq.seq_id] = self._free.pop()
                rows[row] = self._held[seq.seq_id]
        return rows

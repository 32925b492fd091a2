"""Prefix caching for a hybrid model: its recurrent states at block boundaries (vLLM's scheme).

A cached prefix of full KV blocks is only half of what a hybrid needs: its linear-attention layers
need their state after that prefix. The worker keeps a pool of state snapshots; this decides
which snapshot each launch writes and restores.

- Interval: one block. A row whose K/V reach a block boundary in a launch (a decode row crossing
  it, or a prompt chunk ending on it) has its state saved into its request's own snapshot slot,
  overwriting the previous boundary's: a request holds one slot whatever its length, and the copy
  is one state per ``block_size`` tokens against a state read and written every step. A shorter
  interval would not serve a follow-up better; a longer one would lose up to an interval of hits.
- When the request ends (finished, aborted, preempted), its last snapshot is kept under the hash
  of the block that ends at its boundary, if that block was committed (its tokens are the
  request's own, read back): a follow-up turn that resends the history reuses the longest cached
  run of blocks that ends at a snapshot, restores it into its state slot, and computes the rest.
- Kept snapshots are evicted least recently used first when a request needs a slot.
"""

from __future__ import annotations

from collections import OrderedDict

from fusedserve.coordinator.engine.scheduled_batch import ScheduledBatch


class StateSnapshots:
    def __init__(self, slots: int, block_size: int):
        self.block_size = block_size
        self._free = list(range(slots - 1, -1, -1))
        self._cached: OrderedDict[bytes, int] = OrderedDict()  # block hash -> snapshot slot, LRU first
        self._owned: dict[str, tuple[int, int]] = {}  # running request -> (its slot, boundary saved)
        self._restore: dict[str, int] = {}  # admitted on a hit: the snapshot its first chunk starts from

    def usable(self, hashes: list[bytes]) -> int:
        """How many of ``hashes`` (a prompt's cached run of blocks) a hit may cover: up to the last
        one with a snapshot."""
        for n in range(len(hashes), 0, -1):
            if hashes[n - 1] in self._cached:
                return n
        return 0

    def admitted(self, seq_id: str, hashes: list[bytes], blocks: int) -> None:
        """``seq_id`` starts after ``blocks`` cached blocks: its first launch restores their snapshot."""
        if blocks:
            h = hashes[blocks - 1]
            self._cached.move_to_end(h)
            self._restore[seq_id] = self._cached[h]

    def plan(self, batch: ScheduledBatch, state_slots: dict[int, int]
             ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(restores: (snapshot, state slot) before the launch, saves: (state slot, snapshot) after)."""
        restores = []
        for row, seq in enumerate(batch.seqs):
            snap = self._restore.pop(seq.seq_id, None)
            if snap is not None and row >= batch.num_decode and batch.chunk_start(row) > 0:
                restores.append((snap, state_slots[row]))
        keep = {snap for snap, _ in restores}
        saves = []
        speculating = {first for first, _ in batch.spec_groups}  # their states are kept after the launch
        for row, seq in enumerate(batch.seqs):
            reach = batch.computed_to[row]
            if reach % self.block_size or batch.follows(row) or row in speculating:
                continue
            slot = self._slot_for(seq.seq_id, keep)
            if slot is not None:
                self._owned[seq.seq_id] = (slot, reach)
                saves.append((state_slots[row], slot))
        return restores, saves

    def release(self, seq_id: str, hashes: list[bytes]) -> None:
        """``seq_id`` no longer runs here; ``hashes``: its committed blocks' hashes. Its last
        snapshot is kept where the block ending at its boundary is among them."""
        self._restore.pop(seq_id, None)
        owned = self._owned.pop(seq_id, None)
        if owned is None:
            return
        slot, reach = owned
        block = reach // self.block_size - 1
        if block < len(hashes) and hashes[block] not in self._cached:
            self._cached[hashes[block]] = slot
        else:
            self._free.append(slot)

    def _slot_for(self, seq_id: str, keep: set[int]) -> int | None:
        """The request's snapshot slot: its own, else a free one, else the least recently used kept
        one (not one this launch restores from); None when every slot is in use."""
        if seq_id in self._owned:
            return self._owned[seq_id][0]
        if self._free:
            return self._free.pop()
        for h, slot in self._cached.items():
            if slot not in keep:
                del self._cached[h]
                return slot
        return None

"""Hands out a worker's KV blocks to sequences; lives where scheduling happens (the host).

A sequence's token ``p`` is in slot ``table[p // block_size] * block_size + p % block_size``
of the device cache (kernels/kv_cache.py); blocks need not be contiguous or ordered.
"""

from __future__ import annotations

from dataclasses import dataclass


class OutOfBlocks(RuntimeError):
    """The cache has too few free blocks for a request right now."""


@dataclass
class BlockManager:
    """Block ids are plain ints; a sequence's table grows one block at a time as it
    decodes, and every block returns to the free list when the sequence ends.
    """

    num_blocks: int
    block_size: int

    def __post_init__(self) -> None:
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def allocate(self, seq_id: str, num_tokens: int) -> None:
        """Give ``seq_id`` enough blocks for ``num_tokens`` tokens."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        need = self.blocks_for(num_tokens)
        if need > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} blocks, {len(self._free)} free")
        self._tables[seq_id] = [self._free.pop() for _ in range(need)]

    def ensure(self, seq_id: str, num_tokens: int) -> None:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; raises OutOfBlocks."""
        table = self._tables[seq_id]
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} more blocks, {len(self._free)} free")
        for _ in range(need):
            table.append(self._free.pop())

    def table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def free(self, seq_id: str) -> None:
        """Return a sequence's blocks; freeing an unknown sequence is a no-op."""
        self._free.extend(reversed(self._tables.pop(seq_id, [])))

    def slot(self, seq_id: str, position: int) -> int:
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

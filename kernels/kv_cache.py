"""Paged KV cache: fixed-size blocks on the device, and the host-side block allocator.

A sequence's tokens live in the blocks listed by its block table; token ``p`` of a
sequence is in slot ``table[p // block_size] * block_size + p % block_size`` of the
flat cache. Blocks need not be contiguous or ordered.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.config import Qwen3Config


class PagedKVCache:
    """K and V for every layer: ``[layers, 2, num_blocks * block_size, kv_heads, head_dim]``."""

    def __init__(
        self,
        config: Qwen3Config,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.data = torch.zeros(
            config.num_hidden_layers,
            2,
            num_blocks * block_size,
            config.num_key_value_heads,
            config.head_dim,
            dtype=dtype,
            device=device,
        )

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat ``[slots, kv_heads, head_dim]`` views of layer ``i``'s K and V."""
        return self.data[i, 0], self.data[i, 1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class OutOfBlocks(RuntimeError):
    """The cache has too few free blocks for a request right now."""


@dataclass
class BlockManager:
    """Hands out KV blocks to sequences; lives where scheduling happens (the host).

    Block ids are plain ints; a sequence's table grows one block at a time as it
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

    def allocate(self, seq_id: str, num_tokens: int) -> list[int]:
        """Give ``seq_id`` enough blocks for ``num_tokens`` tokens."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        need = self.blocks_for(num_tokens)
        if need > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} blocks, {len(self._free)} free")
        self._tables[seq_id] = [self._free.pop() for _ in range(need)]
        return self._tables[seq_id]

    def ensure(self, seq_id: str, num_tokens: int) -> list[int]:
        """Grow ``seq_id``'s table to hold ``num_tokens`` tokens; raises OutOfBlocks."""
        table = self._tables[seq_id]
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            raise OutOfBlocks(f"sequence {seq_id!r} needs {need} more blocks, {len(self._free)} free")
        for _ in range(need):
            table.append(self._free.pop())
        return table

    def table(self, seq_id: str) -> list[int]:
        return self._tables[seq_id]

    def free(self, seq_id: str) -> None:
        """Return a sequence's blocks; freeing an unknown sequence is a no-op."""
        self._free.extend(reversed(self._tables.pop(seq_id, [])))

    def slot(self, seq_id: str, position: int) -> int:
        table = self._tables[seq_id]
        return table[position // self.block_size] * self.block_size + position % self.block_size

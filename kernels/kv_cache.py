"""Paged KV cache: fixed-size blocks on the device (the allocator is coordinator/engine/block_manager.py).

A sequence's tokens live in the blocks listed by its block table; token ``p`` of a
sequence is in slot ``table[p // block_size] * block_size + p % block_size`` of the
flat cache. Blocks need not be contiguous or ordered.
"""

from __future__ import annotations

import torch

from kernels.model.config import Qwen3Config


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

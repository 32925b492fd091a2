"""Paged KV cache: fixed-size blocks on the device (the allocator is coordinator/engine/block_manager.py).

A sequence's tokens live in the blocks listed by its block table; token ``p`` of a
sequence is in slot ``table[p // block_size] * block_size + p % block_size`` of the
flat cache. Blocks need not be contiguous or ordered.

``kv_cache_dtype="int8"`` halves the bytes a decode step reads from the cache (what bounds it at
long context): each head's row of a token holds its ``head_dim`` values quantized symmetrically
to int8 and then their float32 scale in 4 bytes (``x = q * scale``), written by the layer's cache
write and read by the native kernels (``kernels/native/csrc/kernels.h``: ``kv8_store``).
"""

from __future__ import annotations

import torch

from fusedserve.kernels.host_memory import huge_page_empty
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.model_description.kv_layout import KV8_SCALE_BYTES, kv_element


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 cache rows ``[..., head_dim + 4]`` as ``[..., head_dim]`` values in ``dtype`` (q * scale,
    rounded once, as the native prompt kernel reads them)."""
    d = rows.shape[-1] - KV8_SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return (rows[..., :d].float() * scale).to(dtype)


class PagedKVCache:
    """K and V for every layer: ``[layers, 2, num_blocks * block_size, kv_heads, head_dim]`` in the
    model's dtype, or int8 with 4 more bytes per row (``kv_cache_dtype="int8"``)."""

    def __init__(
        self,
        config: Qwen3Config,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        kv_cache_dtype: str = "auto",
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype
        element, extra = kv_element(dtype, kv_cache_dtype)
        shape = (config.num_hidden_layers, 2, num_blocks * block_size, config.num_key_value_heads,
                 config.head_dim + extra)
        if torch.device(device).type == "cpu":  # long contexts stream it: on huge pages
            self.data = huge_page_empty(shape, element).zero_()
        else:
            self.data = torch.zeros(shape, dtype=element, device=device)
        self._views: tuple[torch.Tensor | None, list] = (None, [])

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat ``[slots, kv_heads, head_dim]`` views of layer ``i``'s K and V (made once for
        ``data``: two indexing ops a layer cost ~20 us a step on a slow core)."""
        data, views = self._views
        if data is not self.data:
            views = [(self.data[j, 0], self.data[j, 1]) for j in range(self.data.shape[0])]
            self._views = (self.data, views)
        return views[i]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

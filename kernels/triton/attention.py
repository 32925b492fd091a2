"""``TritonAttention``: decode rows through the paged flash-decoding kernels (K/V read in place,
split-K); prompt chunks through one varlen kernel over the pages (no loop per prompt, no gather
of a cached prefix). Chosen on CUDA by default after a self-check (``kernels/triton/backend.py``)."""

from __future__ import annotations

import torch

from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.kernels.triton.decode_attention import DecodeAttentionScratch, decode_attention
from fusedserve.kernels.triton.prompt_attention import prompt_attention

TOKENS_PER_SPLIT = 256  # a long context is cut into splits of about this many tokens (at most 16)


class TritonAttention:
    def __init__(self, max_batch: int, max_ctx: int, heads: int, head_dim: int, scale: float,
                 device: torch.device):
        self.scale = scale
        splits = max(1, min(16, max_ctx // TOKENS_PER_SPLIT))
        self.scratch = DecodeAttentionScratch(max_batch, heads, head_dim, splits, device)
        self._batch: ForwardBatch | None = None
        self._block_size = 0

    def begin(self, batch: ForwardBatch, block_size: int) -> None:
        self._batch, self._block_size = batch, block_size

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        b, nd = self._batch, self._batch.num_decode
        if nd:
            decode_attention(q[:nd], k_cache, v_cache, b.block_tables[:nd], b.seq_lens[:nd],
                             self._block_size, self.scale, out[:nd], self.scratch)
        prompt_attention(q, k_cache, v_cache, b.query_start_loc, b.seq_lens, b.block_tables, nd,
                         b.prompt_query_lens, self._block_size, self.scale, out)

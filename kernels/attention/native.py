"""The native CPU attention backend: decode rows read K/V in place from the pages
(``kernels/csrc/attention.cpp``: online softmax in fp32, GQA, cost per row's own length)."""

from __future__ import annotations

from types import ModuleType

import torch

from kernels.attention.prompt_rows import PromptChunk, attend_chunks, plan_chunks
from kernels.forward_batch import ForwardBatch


class NativeAttention:
    def __init__(self, native: ModuleType, scale: float):
        self.native, self.scale = native, scale
        self.name = f"native-{native.isa()}"
        self._batch: ForwardBatch | None = None
        self._block_size = 0
        self._chunks: list[PromptChunk] = []

    def begin(self, batch: ForwardBatch, block_size: int) -> None:
        self._batch, self._block_size = batch, block_size
        self._chunks = plan_chunks(batch, block_size) if batch.prompt_query_lens else []

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        b, nd = self._batch, self._batch.num_decode
        if nd:
            self.native.decode_attention(q[:nd], k_cache, v_cache, b.block_tables[:nd], b.seq_lens[:nd],
                                         self._block_size, self.scale, out[:nd])
        attend_chunks(self._chunks, q, k_cache, v_cache, out, self.scale)

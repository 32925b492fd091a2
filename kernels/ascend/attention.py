"""``AscendAttention``: every row of a launch in one ``npu_fused_infer_attention_score`` call.

The launch's tokens go in TND layout (tokens, heads, head_dim); K and V are read in place from
the pages through the block tables (each layer's cache viewed as [blocks, block_size, KV x hd]).
``sparse_mode=3`` (causal, aligned to the end of each row's context) makes a decode row attend
to its whole context and a prompt chunk causal after whatever its sequence has in the pages: one
call, decode rows and prompt chunks alike, no gather and no loop per prompt.

The op takes each row's query and context lengths as host lists, read once per launch in
``begin``: a host read, so a model on this backend runs without NPU graphs.
"""

from __future__ import annotations

import torch

from fusedserve.kernels.forward_batch import ForwardBatch

CAUSAL_MASK = 2048  # sparse_mode 3 takes a fixed [2048, 2048] upper-triangular mask


class AscendAttention:

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float, device: torch.device):
        import torch_npu

        self.npu = torch_npu
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale
        self.mask = torch.triu(torch.ones(CAUSAL_MASK, CAUSAL_MASK, dtype=torch.int8), diagonal=1).to(device)
        self._batch: ForwardBatch | None = None
        self._q_ends: list[int] = []
        self._kv_lens: list[int] = []
        self._block_size = 0

    def begin(self, batch: ForwardBatch, block_size: int) -> None:
        self._batch, self._block_size = batch, block_size
        self._q_ends = batch.query_start_loc[1:].tolist()
        self._kv_lens = batch.seq_lens.tolist()

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        bs, width = self._block_size, self.kv_heads * self.head_dim
        k = k_cache.view(-1, bs, width)
        v = v_cache.view(-1, bs, width)
        got, _ = self.npu.npu_fused_infer_attention_score(
            q, k, v, atten_mask=self.mask, block_table=self._batch.block_tables.contiguous(),
            input_layout="TND",
            block_size=bs, actual_seq_lengths=self._q_ends, actual_seq_lengths_kv=self._kv_lens,
            num_key_value_heads=self.kv_heads, num_heads=self.heads, scale=self.scale, sparse_mode=3)
        out.copy_(got.view_as(out))

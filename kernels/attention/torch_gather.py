"""The ATen attention backend (CUDA, Ascend, and CPUs without the native build).

Decode rows gather each sequence's context slots from its block table into a scratch
buffer once per layer and run a masked grouped-query attention there: fixed shapes, so a
captured graph replays it. Prompt chunks go through ``prompt_rows``.
"""

from __future__ import annotations

import torch

from kernels.attention.prompt_rows import PromptChunk, attend_chunks, plan_chunks
from kernels.forward_batch import ForwardBatch


class AttentionScratch:
    """Flat scratch sized for ``max_batch`` rows of ``max_ctx`` context slots.

    Views for a step's actual (batch, ctx) are carved from the front of each flat
    buffer, so a step never allocates.
    """

    def __init__(
        self,
        max_batch: int,
        max_ctx: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.max_batch, self.max_ctx = max_batch, max_ctx
        self.h, self.kvh, self.hd = num_heads, num_kv_heads, head_dim
        self.block_size = block_size
        n = max_batch * max_ctx
        kw = {"device": device}
        self.pos = torch.arange(max_ctx, dtype=torch.int32, **kw)
        self.pos_block = torch.div(self.pos, block_size, rounding_mode="floor")
        self.pos_offset = torch.remainder(self.pos, block_size)
        self.block_size_t = torch.tensor(block_size, dtype=torch.int32, **kw)
        self.slots = torch.empty(n, dtype=torch.int32, **kw)
        self.mask = torch.empty(n, dtype=torch.bool, **kw)
        self.gather = torch.empty(n * num_kv_heads * head_dim, dtype=dtype, **kw)
        self.k = torch.empty(n * num_kv_heads * head_dim, dtype=dtype, **kw)
        self.v = torch.empty(n * num_kv_heads * head_dim, dtype=dtype, **kw)
        self.scores = torch.empty(n * num_heads, dtype=dtype, **kw)
        self.row = torch.empty(max_batch * num_heads, dtype=dtype, **kw)
        self.scale = torch.tensor(head_dim**-0.5, dtype=dtype, **kw)

    def prepare(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, ctx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context slot ids [B, ctx] and padding mask [B, ctx] (True = not a token).

        Computed once per step and shared by every layer.
        """
        b = block_tables.shape[0]
        if ctx > self.max_ctx or b > self.max_batch:
            raise ValueError(f"batch {b} x context {ctx} exceeds scratch {self.max_batch} x {self.max_ctx}")
        slots = self.slots[: b * ctx].view(b, ctx)
        torch.index_select(block_tables, 1, self.pos_block[:ctx], out=slots)
        slots.mul_(self.block_size_t).add_(self.pos_offset[:ctx])
        mask = self.mask[: b * ctx].view(b, ctx)
        torch.ge(self.pos[:ctx].unsqueeze(0), seq_lens.unsqueeze(1), out=mask)
        return slots, mask


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float | None,
    scratch: AttentionScratch,
    out: torch.Tensor,
) -> torch.Tensor:
    """One query token per sequence against its paged context.

    q: [B, heads, head_dim]; k_cache/v_cache: flat [slots, kv_heads, head_dim];
    slots/mask from ``AttentionScratch.prepare``; out: [B, heads, head_dim].
    ``scale=None`` uses the scratch's preboxed head_dim**-0.5 (no per-step boxing).
    Query head ``h`` reads KV head ``h // (heads // kv_heads)``, as in transformers.
    """
    b, ctx = slots.shape
    s = scratch
    g = s.h // s.kvh
    flat_slots = slots.view(-1)
    gathered = s.gather[: b * ctx * s.kvh * s.hd].view(b * ctx, s.kvh, s.hd)
    k = s.k[: b * ctx * s.kvh * s.hd].view(b, s.kvh, ctx, s.hd)
    v = s.v[: b * ctx * s.kvh * s.hd].view(b, s.kvh, ctx, s.hd)
    torch.index_select(k_cache, 0, flat_slots, out=gathered)
    k.copy_(gathered.view(b, ctx, s.kvh, s.hd).transpose(1, 2))
    torch.index_select(v_cache, 0, flat_slots, out=gathered)
    v.copy_(gathered.view(b, ctx, s.kvh, s.hd).transpose(1, 2))

    scores = s.scores[: b * s.h * ctx].view(b, s.kvh, g, ctx)
    torch.matmul(q.view(b, s.kvh, g, s.hd), k.transpose(-1, -2), out=scores)
    scores.mul_(s.scale if scale is None else scale)
    # A Python scalar, not a 0-dim tensor: CUDA's masked_fill_ reads a tensor value with
    # .item(), a host sync that graph capture forbids.
    scores.masked_fill_(mask.view(b, 1, 1, ctx), float("-inf"))
    row = s.row[: b * s.h].view(b, s.kvh, g, 1)
    torch.amax(scores, dim=-1, keepdim=True, out=row)
    scores.sub_(row).exp_()
    torch.sum(scores, dim=-1, keepdim=True, out=row)
    scores.div_(row)
    torch.matmul(scores, v, out=out.view(b, s.kvh, g, s.hd))
    return out


class TorchAttention:
    def __init__(self, scratch: AttentionScratch, scale: float):
        self.scratch, self.scale = scratch, scale
        self.name = "aten-gather"
        self._num_decode = 0
        self._slots_mask: tuple[torch.Tensor, torch.Tensor] | None = None
        self._chunks: list[PromptChunk] = []

    def begin(self, batch: ForwardBatch, block_size: int) -> None:
        nd = self._num_decode = batch.num_decode
        if nd:  # once per launch, shared by every layer
            ctx = batch.block_tables.shape[1] * block_size
            self._slots_mask = self.scratch.prepare(batch.block_tables[:nd], batch.seq_lens[:nd], ctx)
        self._chunks = plan_chunks(batch, block_size) if batch.prompt_query_lens else []

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None:
        nd = self._num_decode
        if nd:
            paged_decode_attention(q[:nd], k_cache, v_cache, *self._slots_mask, None, self.scratch, out[:nd])
        attend_chunks(self._chunks, q, k_cache, v_cache, out, self.scale)

"""Prompt chunks' attention: each chunk against its sequence's pages, causal within itself.

A chunk of ``n`` new tokens whose sequence holds ``ctx`` tokens after this launch (the ``n``
just written, and ``p = ctx - n`` before them) reads all ``ctx`` from the pages by its block
table, so a cached prefix and earlier chunks are the same case. Query ``j`` sits at position
``p + j`` and sees keys ``0 .. p + j``. One SDPA call per chunk: prompts vary in length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.kernels.kv_cache import dequantize_rows


@dataclass
class PromptChunk:
    start: int  # its first token in the packed batch
    end: int
    slots: torch.Tensor  # [ctx] int64: its sequence's K/V slots, in position order


def plan_chunks(batch: ForwardBatch, block_size: int) -> list[PromptChunk]:
    """Where each prompt chunk's tokens and context are (slots computed on the device)."""
    chunks, start = [], batch.num_decode
    for i, n in enumerate(batch.prompt_query_lens):
        chunks.append(plan_chunk(batch, i, start, block_size))
        start += n
    return chunks


def plan_chunk(batch: ForwardBatch, i: int, start: int, block_size: int) -> PromptChunk:
    """Prompt chunk ``i`` of the batch, its first token at ``start`` in the packed batch."""
    n, ctx = batch.prompt_query_lens[i], batch.prompt_seq_lens[i]
    dev = batch.block_tables.device
    blocks = batch.block_tables[batch.num_decode + i, : -(-ctx // block_size)].to(torch.int64)
    offsets = torch.arange(block_size, dtype=torch.int64, device=dev)
    slots = (blocks[:, None] * block_size + offsets).flatten()[:ctx]
    return PromptChunk(start, start + n, slots)


def attend_chunks(chunks: list[PromptChunk], q: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """q/out: [T, heads, hd] for the whole batch; only the chunks' rows are written. int8 caches'
    rows are dequantized to q's dtype."""
    for c in chunks:
        n, ctx = c.end - c.start, c.slots.shape[0]
        qs = q[c.start : c.end].transpose(0, 1).unsqueeze(0)
        ks, vs = k_cache.index_select(0, c.slots), v_cache.index_select(0, c.slots)
        if ks.dtype == torch.int8:
            ks, vs = dequantize_rows(ks, q.dtype), dequantize_rows(vs, q.dtype)
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        p = ctx - n
        if p:
            mask = torch.ones(n, ctx, dtype=torch.bool, device=q.device).tril(diagonal=p)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out[c.start : c.end] = o.squeeze(0).transpose(0, 1)

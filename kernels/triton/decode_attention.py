"""Paged decode attention as Triton kernels: each decode row's query against its context, read
in place from the KV pages through its block table (no gather into scratch), flash-decoding.

- Split-K: each row's own context is cut into ``splits`` equal ranges (rounded up to the key
  tile), planned in the kernel from the row's length on the device, so a graph replays it for
  any lengths; one program per (row, KV head, split) runs an online softmax (fp32) over its
  range for every q head of the KV head's group (GQA: each K/V row is loaded once for the
  group). A row's cost and its parallelism follow its own length, not ``max_model_len`` nor
  the batch's longest row.
- A second kernel merges each row's splits (log-sum-exp weights) into ``out``.

Shapes: q [B, NH, HD]; k_cache, v_cache [slots, NKV, HD] (slot = block * block_size + offset);
block_tables [B, W] int32; seq_lens [B] int32 (the context, this token included); out like q.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl


# The table's row stride changes between launches: not specialised on.
@triton.jit(do_not_specialize=["stride_tb"])
def _split_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr, scale,
                  stride_qb, stride_qh, stride_slot, stride_kvh, stride_tb,
                  GROUP: tl.constexpr, GROUP_P: tl.constexpr, HD: tl.constexpr, BLOCK_N: tl.constexpr,
                  BS: tl.constexpr, SPLITS: tl.constexpr, NH: tl.constexpr):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + row)
    chunk = tl.cdiv(tl.cdiv(seq_len, SPLITS), BLOCK_N) * BLOCK_N  # this row's own split length
    start = split * chunk
    g = tl.arange(0, GROUP_P)
    d = tl.arange(0, HD)
    gmask = g < GROUP
    heads = kvh * GROUP + g
    part = (row * NH + heads) * SPLITS + split  # this split's slot for each q head
    if start >= seq_len:
        tl.store(m_ptr + part, tl.full([GROUP_P], float("-inf"), tl.float32), mask=gmask)
        tl.store(l_ptr + part, tl.zeros([GROUP_P], tl.float32), mask=gmask)
        return
    q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None],
                other=0.0).to(tl.float32) * scale
    m_i = tl.full([GROUP_P], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_P], tl.float32)
    acc = tl.zeros([GROUP_P, HD], tl.float32)
    end = tl.minimum(start + chunk, seq_len)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        block = tl.load(tables_ptr + row * stride_tb + pos // BS, mask=valid, other=0)
        slot = block.to(tl.int64) * BS + pos % BS
        kv_off = slot[:, None] * stride_slot + kvh * stride_kvh + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP_P, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    tl.store(m_ptr + part, m_i, mask=gmask)
    tl.store(l_ptr + part, l_i, mask=gmask)
    tl.store(acc_ptr + part[:, None] * HD + d[None, :], acc, mask=gmask[:, None])


@triton.jit
def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh, NH: tl.constexpr,
                  SPLITS: tl.constexpr, SPLITS_P: tl.constexpr, HD: tl.constexpr):
    row = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS_P)
    d = tl.arange(0, HD)
    base = (row * NH + h) * SPLITS
    inside = sp < SPLITS
    m = tl.load(m_ptr + base + sp, mask=inside, other=float("-inf"))
    m_max = tl.max(m, axis=0)
    w = tl.where(inside & (m > float("-inf")), tl.exp(m - m_max), 0.0)
    l_sum = tl.sum(tl.load(l_ptr + base + sp, mask=inside, other=0.0) * w, axis=0)
    acc = tl.load(acc_ptr + (base + sp)[:, None] * HD + d[None, :], mask=(inside & (w > 0))[:, None],
                  other=0.0)
    o = tl.sum(acc * w[:, None], axis=0) / l_sum
    tl.store(out_ptr + row * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


def split_block_n(group_p: int, block_n: int = 16) -> int:
    """Keys per tile: the products tile is ``group_p x block_n x head_dim`` in registers, so a
    large GQA group takes fewer keys (at most 128 group x key pairs: 16 x 8 for the 235B's
    group of 16, which spills at 16 x 16; ``fusedserve.kernels.triton.aot_check`` reads ptxas's count)."""
    return max(4, min(block_n, 128 // group_p))


class DecodeAttentionScratch:
    """The splits' partial results for ``max_batch`` rows, allocated once (a step allocates
    nothing, so a device graph can capture the two launches)."""

    def __init__(self, max_batch: int, heads: int, head_dim: int, splits: int,
                 device: torch.device | str):
        self.splits = splits
        n = max_batch * heads * splits
        self.m = torch.empty(n, dtype=torch.float32, device=device)
        self.l = torch.empty(n, dtype=torch.float32, device=device)
        self.acc = torch.empty(n * head_dim, dtype=torch.float32, device=device)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, scale: float,
                     out: torch.Tensor, scratch: DecodeAttentionScratch, block_n: int = 16) -> None:
    """``out[b, h] = softmax(q[b, h] . K_b / sqrt) V_b`` over row b's ``seq_lens[b]`` context
    tokens, each row cut into the scratch's split count by its own length."""
    b, nh, hd = q.shape
    nkv = k_cache.shape[1]
    if b == 0:
        return
    if hd & (hd - 1):
        raise ValueError(f"decode_attention: head_dim {hd} must be a power of two")
    splits = scratch.splits
    group = nh // nkv
    group_p = max(triton.next_power_of_2(group), 2)
    block_n = split_block_n(group_p, block_n)
    _split_kernel[(b, nkv, splits)](
        q, k_cache, v_cache, block_tables, seq_lens, scratch.m, scratch.l, scratch.acc, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_P=group_p, HD=hd, BLOCK_N=block_n,
        BS=block_size, SPLITS=splits, NH=nh)
    _merge_kernel[(b, nh)](scratch.m, scratch.l, scratch.acc, out, out.stride(0), out.stride(1), NH=nh,
                           SPLITS=splits, SPLITS_P=max(triton.next_power_of_2(splits), 2), HD=hd)

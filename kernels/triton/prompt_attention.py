"""Prompt chunks' attention as one Triton kernel over the pages: no Python loop per prompt and
no gather of a cached prefix. One program per (prompt row, q head, block of the chunk's
queries) walks the row's context through its block table in tiles of ``BLOCK_N`` keys, causal
(query at position p sees keys 0..p: a cached prefix and earlier chunks are the same case),
with an online softmax in fp32 and ``tl.dot`` for both products. The chunk's own K/V are in
the pages already (the layer writes them first).

Shapes: q, out [T, NH, HD] (the whole launch; only prompt rows' tokens are written);
query_start_loc [B + 1], seq_lens [B], block_tables [B, W]; rows ``first_row``.. are prompts.
"""

from __future__ import annotations

import os

import torch

import triton
import triton.language as tl

# Triton's CPU interpreter (3.9, with torch 2.13) returns garbage from tl.dot of 16-bit inputs:
# under it the products take float32 inputs; compiled for a GPU they stay 16-bit.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: on NVIDIA a float32 product defaults to TF32 (10-bit
    mantissa: about 1e-3 off), which the interpreter does not emulate; float32 inputs get IEEE."""
    return "ieee" if dtype == torch.float32 or _INTERPRETED else "tf32"


# first_row and the table's row stride change from launch to launch: specialising on them
# (== 1, divisible by 16) would compile the kernel again mid-serving.
@triton.jit(do_not_specialize=["first_row", "stride_tb"])
def _prompt_kernel(q_ptr, k_ptr, v_ptr, out_ptr, qsl_ptr, lens_ptr, tables_ptr, scale, first_row,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_slot, stride_kvh, stride_tb,
                   GROUP: tl.constexpr, HD: tl.constexpr, BS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    row = first_row + tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    t0 = tl.load(qsl_ptr + row)
    n_q = tl.load(qsl_ptr + row + 1) - t0
    if mb * BLOCK_M >= n_q:
        return
    ctx = tl.load(lens_ptr + row)
    prefix = ctx - n_q
    m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    q_valid = m < n_q
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (t0 + m)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=q_valid[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    q_pos = prefix + m
    kvh = h // GROUP
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    last = tl.minimum(prefix + (mb + 1) * BLOCK_M, ctx)  # keys past the block's last query are masked
    for n0 in range(0, last, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        k_valid = pos < last
        block = tl.load(tables_ptr + row * stride_tb + pos // BS, mask=k_valid, other=0)
        slot = block.to(tl.int64) * BS + pos % BS
        kv_off = slot[:, None] * stride_slot + kvh * stride_kvh + d[None, :]
        k = tl.load(k_ptr + kv_off, mask=k_valid[:, None], other=0.0)
        v = tl.load(v_ptr + kv_off, mask=k_valid[:, None], other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
        keep = k_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(out_ptr + (t0 + m)[:, None] * stride_ot + h * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=q_valid[:, None])


def prompt_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                     first_row: int, query_lens: list[int], block_size: int, scale: float,
                     out: torch.Tensor, block_m: int = 16, block_n: int = 16) -> None:
    """Attention for the prompt rows ``first_row``..; ``query_lens``: their new tokens (host)."""
    if not query_lens:
        return
    nh, hd = q.shape[1], q.shape[2]
    if hd & (hd - 1) or hd < 16:
        raise ValueError(f"prompt_attention: head_dim {hd} must be a power of two >= 16")
    grid = (len(query_lens), nh, triton.cdiv(max(query_lens), block_m))
    _prompt_kernel[grid](q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, scale,
                         first_row, q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
                         k_cache.stride(1), block_tables.stride(0), GROUP=nh // k_cache.shape[1], HD=hd,
                         BS=block_size, BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=_INTERPRETED,
                         PRECISION=dot_precision(q.dtype))

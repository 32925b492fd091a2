"""The layer ops between matmuls as Triton kernels, each one pass over its rows, rounded as
transformers' Qwen3 rounds in the model's dtype (as ``TorchLayerOps`` and the native CPU
passes do): the normalised value is rounded to the dtype before the weight multiplies it;
rotary rounds x*cos and rotate_half(x)*sin before adding them.

- ``add_rms_norm``: ``x += add`` (optional), ``out = rms_norm(x) * w``; one program a row.
- ``qk_norm_rope``: one program per (token, head): a q head normed and rotated into ``q_out``;
  a k head normed and rotated in place and written, with its v head, into the cache slot of
  its token (``slot_mapping``): the K/V cache write fused into the pass that makes K.
- ``silu_mul``: ``out = silu(gate) * up``; one program per (row, block of columns).
- ``apply_token_bitmask``: a grammar's bitmask onto the logits, ``-inf`` where a bit is clear.

The kernels use only ``tl`` operations present in Triton 3.6 and 3.9.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(x_ptr, add_ptr, w_ptr, out_ptr, D, stride_x, stride_a, stride_o, eps,
                         HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_ADD:
        a = tl.load(add_ptr + row * stride_a + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + a.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) * (1.0 / D) + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xf * r).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rope_head(src, w_ptr, cos_ptr, sin_ptr, eps, HD: tl.constexpr, HALF: tl.constexpr):
    """One head [HD] in fp32: RMSNorm (rounded to the dtype, times the weight, rounded), then
    rotate-half rotary with this token's cos/sin rows. Returns the result in the dtype."""
    dt = src.dtype.element_ty
    lo = tl.arange(0, HALF)
    x1 = tl.load(src + lo).to(tl.float32)
    x2 = tl.load(src + HALF + lo).to(tl.float32)
    r = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) * (1.0 / HD) + eps)
    n1 = ((x1 * r).to(dt).to(tl.float32) * tl.load(w_ptr + lo).to(tl.float32)).to(dt).to(tl.float32)
    n2 = ((x2 * r).to(dt).to(tl.float32) * tl.load(w_ptr + HALF + lo).to(tl.float32)).to(dt).to(tl.float32)
    c1, c2 = tl.load(cos_ptr + lo).to(tl.float32), tl.load(cos_ptr + HALF + lo).to(tl.float32)
    s1, s2 = tl.load(sin_ptr + lo).to(tl.float32), tl.load(sin_ptr + HALF + lo).to(tl.float32)
    # rotate_half(x) = [-x2, x1]; each product rounded before the sum, as transformers does.
    y1 = (n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)
    y2 = (n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)
    return y1.to(dt), y2.to(dt)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                         slot_ptr, stride_qkv, stride_cs, stride_q, stride_slot, eps,
                         NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    lo = tl.arange(0, HALF)
    row = qkv_ptr + t * stride_qkv
    cos, sin = cos_ptr + t * stride_cs, sin_ptr + t * stride_cs
    if h < NH:
        y1, y2 = _norm_rope_head(row + h * HD, qw_ptr, cos, sin, eps, HD, HALF)
        dst = q_out_ptr + t * stride_q + h * HD
        tl.store(dst + lo, y1)
        tl.store(dst + HALF + lo, y2)
    else:
        j = h - NH
        k = row + (NH + j) * HD
        y1, y2 = _norm_rope_head(k, kw_ptr, cos, sin, eps, HD, HALF)
        tl.store(k + lo, y1)
        tl.store(k + HALF + lo, y2)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        kc = k_cache_ptr + slot * stride_slot + j * HD
        tl.store(kc + lo, y1)
        tl.store(kc + HALF + lo, y2)
        v = row + (NH + NKV + j) * HD
        vc = v_cache_ptr + slot * stride_slot + j * HD
        tl.store(vc + lo, tl.load(v + lo))
        tl.store(vc + HALF + lo, tl.load(v + HALF + lo))


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, N, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + N + cols, mask=mask, other=0.0).to(tl.float32)
    # silu rounded to the dtype first, as F.silu(gate, inplace=True) leaves it before the multiply.
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _token_bitmask_kernel(logits_ptr, mask_ptr, V, W, stride_l, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    v = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = v < V
    words = tl.load(mask_ptr + row * W + (v >> 5), mask=inside, other=-1)
    allowed = ((words >> (v & 31)) & 1) != 0
    tl.store(logits_ptr + row * stride_l + v, float("-inf"), mask=inside & (~allowed))


def add_rms_norm(x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> None:
    n, d = x.shape
    if n == 0:
        return
    a = add if add is not None else x
    _add_rms_norm_kernel[(n,)](x, a, weight, out, d, x.stride(0), a.stride(0), out.stride(0), eps,
                               HAS_ADD=add is not None, BLOCK=triton.next_power_of_2(d))


def qk_norm_rope(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, eps: float, q_out: torch.Tensor, heads: int, kv_heads: int,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    n = qkv.shape[0]
    hd = q_out.shape[-1]
    if n == 0:
        return
    if hd & (hd - 1):
        raise ValueError(f"qk_norm_rope: head_dim {hd} must be a power of two")
    _qk_norm_rope_kernel[(n, heads + kv_heads)](
        qkv, q_weight, k_weight, cos, sin, q_out, k_cache, v_cache, slot_mapping, qkv.stride(0),
        cos.stride(0), q_out.stride(0), k_cache.stride(0), eps, NH=heads, NKV=kv_heads, HD=hd, HALF=hd // 2)


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor, block: int = 1024) -> None:
    n, inter = out.shape
    if n == 0:
        return
    _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                     BLOCK=block)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, block: int = 4096) -> None:
    b, vocab = logits.shape
    if b == 0:
        return
    _token_bitmask_kernel[(b, triton.cdiv(vocab, block))](logits, bitmask, vocab, bitmask.shape[1],
                                                          logits.stride(0), BLOCK=block)

"""Allocation-free building blocks of the decode step.

Every function writes into tensors the caller owns (``out=`` or in place), so a
decode step built from them allocates nothing once its workspace exists. The math
follows transformers' Qwen3 (RMSNorm in float32, rotate-half rotary embedding).
"""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float | torch.Tensor,
    out: torch.Tensor,
    f32: torch.Tensor,
    var: torch.Tensor,
    inv_dim: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out = weight * x / rms(x)`` over the last dim, computed in float32.

    ``f32`` is scratch shaped like ``x`` in float32; ``var`` is ``x.shape[:-1] + (1,)``.
    ``out`` may alias ``x``. ``inv_dim`` (a 0-dim float32 ``1 / dim``) avoids the
    temporary that ``torch.mean`` allocates for its divisor.
    """
    f32.copy_(x)
    torch.sum(f32.square_(), dim=-1, keepdim=True, out=var)
    var.mul_(1.0 / x.shape[-1] if inv_dim is None else inv_dim)
    var.add_(eps).rsqrt_()
    f32.copy_(x)
    f32.mul_(var)
    out.copy_(f32)
    out.mul_(weight)
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, tmp: torch.Tensor) -> None:
    """Apply rotate-half rotary embedding to ``x`` [N, heads, head_dim] in place.

    ``cos``/``sin`` are [N, 1, head_dim]; ``tmp`` is scratch shaped like ``x``.
    """
    half = x.shape[-1] // 2
    torch.neg(x[..., half:], out=tmp[..., :half])
    tmp[..., half:].copy_(x[..., :half])
    tmp.mul_(sin)
    x.mul_(cos)
    x.add_(tmp)


def rope_tables(
    head_dim: int, theta: float, max_positions: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim], computed in float32 like transformers."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = x @ weight.T`` for a [out_features, in_features] weight."""
    return torch.mm(x, weight.t(), out=out)


def linear_gemv(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``linear`` through ATen's native kernel rather than oneDNN (faster for one bf16 row).

    The oneDNN switch is process-global: it is restored before returning.
    """
    previous = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        return torch.mm(x, weight.t(), out=out)
    finally:
        torch._C._set_mkldnn_enabled(previous)

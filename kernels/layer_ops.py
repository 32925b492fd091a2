"""A layer's ops between its matmuls: the native CPU passes, or ATen's ops elsewhere.

``NativeLayerOps`` and ``TorchLayerOps`` are the two implementations of one interface, chosen
once per model (``kernels/backend.py``): a fused residual add + RMSNorm; the per-head q/k
RMSNorm + rotary that Qwen3 applies before attention, with this launch's K and V written into
their cache slots; the MLP's SiLU x up; and, before sampling, a grammar's token bitmask. Both
write into tensors the caller owns, so a decode step allocates nothing. The math follows
transformers' Qwen3 (RMSNorm in float32, rotate-half rotary embedding), rounded in the model's
dtype as it rounds.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from kernels import sampler


@dataclass
class NormScratch:
    """float32 scratch of ``TorchLayerOps`` for n rows (the native pass needs none)."""

    f32_h: torch.Tensor  # [n, D]
    var_h: torch.Tensor  # [n, 1]
    f32_q: torch.Tensor  # [n, heads, hd]
    var_q: torch.Tensor  # [n, heads, 1]
    f32_k: torch.Tensor  # [n, kv_heads, hd]
    var_k: torch.Tensor  # [n, kv_heads, 1]
    rot_q: torch.Tensor  # [n, heads, hd], activation dtype
    rot_k: torch.Tensor  # [n, kv_heads, hd]

    @classmethod
    def allocate(cls, n: int, hidden: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> NormScratch:
        f32 = {"dtype": torch.float32, "device": device}
        act = {"dtype": dtype, "device": device}
        return cls(torch.empty(n, hidden, **f32), torch.empty(n, 1, **f32),
                   torch.empty(n, heads, head_dim, **f32), torch.empty(n, heads, 1, **f32),
                   torch.empty(n, kv_heads, head_dim, **f32), torch.empty(n, kv_heads, 1, **f32),
                   torch.empty(n, heads, head_dim, **act), torch.empty(n, kv_heads, head_dim, **act))

    def rows(self, n: int) -> NormScratch:
        return NormScratch(self.f32_h[:n], self.var_h[:n], self.f32_q[:n], self.var_q[:n], self.f32_k[:n],
                           self.var_k[:n], self.rot_q[:n], self.rot_k[:n])


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


class NativeLayerOps:
    """One pass per row (add + norm), per head (norm + rotary + cache write) and per row of the
    MLP (SiLU x up): ``kernels/csrc/norm.cpp``."""

    def __init__(self, native: ModuleType, eps: float, heads: int, kv_heads: int):
        self.native, self.eps, self.heads, self.kv_heads = native, eps, heads, kv_heads

    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, buf: NormScratch) -> None:
        """``x += add`` (if given), then ``out = rms_norm(x) * weight``."""
        self.native.add_rms_norm(x, add, weight, self.eps, out)

    def qk_norm_rope(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, buf: NormScratch,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """q heads of ``qkv`` normed and rotated into ``q_out`` [n, heads, hd]; k heads in place;
        each token's k and v heads into row ``slot_mapping[t]`` of the caches."""
        self.native.qk_norm_rope(qkv, q_weight, k_weight, cos, sin, self.eps, q_out, self.heads,
                                 self.kv_heads, k_cache, v_cache, slot_mapping)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """``out = silu(gate) * up`` for ``gate_up = [gate, up]``."""
        self.native.silu_mul(gate_up, out)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """``logits[b, v] = -inf`` where bit v of ``bitmask[b]`` is clear (one pass, in place)."""
        self.native.apply_token_bitmask(logits, bitmask)


class TorchLayerOps:
    """ATen's ops over the layer buffers' float32 scratch (eight ops a norm)."""

    def __init__(self, eps: float, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 device: torch.device):
        f32 = {"dtype": torch.float32, "device": device}
        # 0-dim constants: a Python scalar operand would be boxed into a new tensor per op.
        self.eps = torch.tensor(eps, **f32)
        self.inv_hidden = torch.tensor(1.0 / hidden, **f32)
        self.inv_head = torch.tensor(1.0 / head_dim, **f32)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.bit_table = sampler.bit_table(device)

    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, buf: NormScratch) -> None:
        if add is not None:
            x.add_(add)
        n = x.shape[0]
        rms_norm(x, weight, self.eps, out, buf.f32_h[:n], buf.var_h[:n], self.inv_hidden)

    def qk_norm_rope(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, buf: NormScratch,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        n, nh, nkv, hd = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        q = qkv[:, : nh * hd].view(n, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].view(n, nkv, hd)
        rms_norm(q, q_weight, self.eps, q_out, buf.f32_q[:n], buf.var_q[:n], self.inv_head)
        rms_norm(k, k_weight, self.eps, k, buf.f32_k[:n], buf.var_k[:n], self.inv_head)
        cos3, sin3 = cos.unsqueeze(1), sin.unsqueeze(1)
        rotary(q_out, cos3, sin3, buf.rot_q[:n])
        rotary(k, cos3, sin3, buf.rot_k[:n])
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, qkv[:, (nh + nkv) * hd :].view(n, nkv, hd))

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        gate = gate_up[:, : out.shape[1]]
        torch.nn.functional.silu(gate, inplace=True)
        torch.mul(gate, gate_up[:, out.shape[1] :], out=out)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        allowed = sampler.allowed_tokens(bitmask, logits.shape[1], self.bit_table)
        logits.masked_fill_(allowed.logical_not_(), float("-inf"))

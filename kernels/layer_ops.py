"""A layer's ops between its matmuls: the ``LayerOps`` interface every backend implements,
and the float32 math the ATen and reference paths share.

``LayerOps`` is one interface with four implementations, one per backend (``kernels/backend_table.py``:
native, aten, triton, ascend), chosen once per model: a fused residual add + RMSNorm; the per-head
q/k RMSNorm + rotary that Qwen3 applies before attention, with this launch's K and V written into
their cache slots; the MLP's SiLU x up; and, before sampling, a grammar's token bitmask. Each
writes into tensors the caller owns, so a decode step allocates nothing. The math follows
transformers' Qwen3 (RMSNorm in float32, rotate-half rotary embedding), rounded in the model's
dtype as it rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch


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
    head_dim: int, theta: float, max_positions: int, dtype: torch.dtype, yarn: dict | None = None,
    original_positions: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim], computed in float32 like transformers; with
    ``yarn`` (its rope parameters) the frequencies and scale of YaRN, as transformers computes
    them (``original_positions``: the window the model was trained on, when the config omits it)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scale = 1.0
    if yarn is not None:
        inv_freq, scale = _yarn(head_dim, theta, yarn, original_positions)
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotary_permutation(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Partial rotary (a hybrid's: the first ``rotary_dim`` dims of a head rotate, pairing i with
    i + rotary_dim / 2) as full-head rotate-half: a head's dims reordered so that each rotated pair
    sits at (j, j + head_dim / 2), the unrotated dims after them in each half. Applied to q and k
    alike (and their norms), it leaves every q.k unchanged, so the layer ops' rotary serves both
    kinds; ``partial_rope_tables`` gives the unrotated dims cos 1, sin 0."""
    r, rest = rotary_dim // 2, (head_dim - rotary_dim) // 2
    return torch.cat([torch.arange(r), torch.arange(rotary_dim, rotary_dim + rest),
                      torch.arange(r, 2 * r), torch.arange(rotary_dim + rest, head_dim)])


def partial_rope_tables(cos: torch.Tensor, sin: torch.Tensor,
                        head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_tables`` of the rotary dims [P, rotary_dim] widened to the permuted head [P, head_dim]
    (``rotary_permutation``): x * 1 + rotate_half(x) * 0 leaves an unrotated dim exactly as it was."""
    r = cos.shape[1] // 2
    pad = head_dim // 2 - r
    one = torch.ones(cos.shape[0], pad, dtype=cos.dtype)
    zero = torch.zeros(cos.shape[0], pad, dtype=cos.dtype)
    return (torch.cat([cos[:, :r], one, cos[:, r:], one], dim=1),
            torch.cat([sin[:, :r], zero, sin[:, r:], zero], dim=1))


def _yarn(dim: int, base: float, p: dict, original_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies (interpolated below the correction range, extrapolated above it,
    a linear ramp between) and its attention scale, transformers' ``_compute_yarn_parameters``."""
    factor = float(p["factor"])
    original = p.get("original_max_position_embeddings") or original_positions

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        m, m_all = p.get("mscale"), p.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast") or 32), correction_dim(p.get("beta_slow") or 1)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


class LayerOps(Protocol):
    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, buf: NormScratch) -> None:
        """``x += add`` (if given), then ``out = rms_norm(x) * weight``."""

    def qk_norm_rope(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, buf: NormScratch,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """q heads of ``qkv`` normed and rotated into ``q_out`` [n, heads, hd]; k heads in place;
        each token's k and v heads into row ``slot_mapping[t]`` of the caches."""

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """``out = silu(gate) * up`` for ``gate_up = [gate, up]``."""

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        """``logits[b, v] = -inf`` where bit v of ``bitmask[b]`` is clear (in place)."""

"""A hybrid's zero-centred RMSNorms (Qwen3-Next, Qwen3.5), rounded as transformers rounds them.

Qwen3's norm rounds the normalised row to the model's dtype and then multiplies by the weight;
these compute ``x / rms(x) * (1 + w)`` in float32 and round once (``hybrid_loader.norm`` stores
``1 + w`` in float32). The difference is a bf16 rounding step per norm, which over a model's
layers and its q/k norms is most of the bf16 error a Qwen3-style norm would add. Same call shapes
as ``LayerOps.add_rms_norm`` and ``qk_norm_rope`` (K/V rows written as they are, or quantized into
an int8 cache by the native pass).
With the native CPU kernels, their float32-weight passes (``csrc/norm.cpp``) do the same in one pass
per row and per head; else torch.
"""

from __future__ import annotations

import torch

from fusedserve.kernels.layer_ops import NormScratch, rotary
from fusedserve.kernels.model_description.config import Qwen3Config


class HybridNorms:
    def __init__(self, c: Qwen3Config, native=None):
        self.c = c
        self.eps = c.rms_norm_eps
        self.native = native

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                     buf: NormScratch | None = None) -> None:
        """``x += add`` (in x's dtype, as the residual adds), then ``out`` = the normed row."""
        if self.native is not None:
            self.native.add_rms_norm(x, add, weight, self.eps, out)
            return
        if add is not None:
            x.add_(add)
        out.copy_(self._norm(x, weight))

    def qk_norm_rope(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, buf: NormScratch,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """q and k heads normed and rotated (in the model's dtype, as transformers rotates), q into
        ``q_out``, k and v into their cache rows."""
        c, n = self.c, qkv.shape[0]
        hd = c.head_dim
        if self.native is not None:
            self.native.qk_norm_rope(qkv, q_weight, k_weight, cos, sin, self.eps, q_out,
                                     c.num_attention_heads, c.num_key_value_heads, k_cache, v_cache,
                                     slot_mapping)
            return
        if k_cache.dtype == torch.int8:
            raise ValueError("an int8 KV cache is written by the native CPU kernels only")
        q = qkv[:, : c.q_size].view(n, -1, hd)
        k = qkv[:, c.q_size : c.q_size + c.kv_size].view(n, -1, hd)
        v = qkv[:, c.q_size + c.kv_size :].view(n, -1, hd)
        q_out.copy_(self._norm(q, q_weight))
        k_rot = self._norm(k, k_weight).to(qkv.dtype)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        rotary(q_out, cos, sin, torch.empty_like(q_out))
        rotary(k_rot, cos, sin, torch.empty_like(k_rot))
        k_cache.index_copy_(0, slot_mapping, k_rot)
        v_cache.index_copy_(0, slot_mapping, v)

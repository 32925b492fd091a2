"""``AscendLayerOps``: the layer-ops interface of ``kernels/layer_ops.py`` on torch_npu's fused ops.

- residual add + RMSNorm: ``npu_add_rms_norm`` (one op: the sum and the normed output), or
  ``npu_rms_norm`` without an add;
- q/k RMSNorm + rotary: ``npu_rms_norm`` over the heads, ``npu_rotary_mul`` (rotate-half, as
  Qwen3), then the K/V cache write through the slot mapping (``index_copy_``);
- SiLU x up: ``npu_swiglu`` over ``[gate, up]``;
- the grammar bitmask: ATen's lookup (``TorchLayerOps``').
"""

from __future__ import annotations

import torch

from fusedserve.kernels.aten.backend import TorchLayerOps
from fusedserve.kernels.layer_ops import NormScratch


class AscendLayerOps(TorchLayerOps):
    def __init__(self, eps: float, hidden: int, heads: int, kv_heads: int, head_dim: int,
                 device: torch.device):
        super().__init__(eps, hidden, heads, kv_heads, head_dim, device)
        import torch_npu

        self.npu, self.eps_f = torch_npu, eps

    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, buf: NormScratch) -> None:
        if add is None:
            out.copy_(self.npu.npu_rms_norm(x, weight, self.eps_f)[0])
            return
        y, _, summed = self.npu.npu_add_rms_norm(x, add, weight, self.eps_f)
        x.copy_(summed)
        out.copy_(y)

    def qk_norm_rope(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, buf: NormScratch,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        n, nh, nkv, hd = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        q = qkv[:, : nh * hd].reshape(n, nh, hd)
        k = qkv[:, nh * hd : (nh + nkv) * hd].reshape(n, nkv, hd)
        q = self.npu.npu_rms_norm(q, q_weight, self.eps_f)[0]
        k = self.npu.npu_rms_norm(k, k_weight, self.eps_f)[0]
        cos4, sin4 = cos.view(1, n, 1, hd), sin.view(1, n, 1, hd)  # [B=1, S=n, N, D] layout
        q_out.copy_(self.npu.npu_rotary_mul(q.unsqueeze(0), cos4, sin4).squeeze(0))
        k = self.npu.npu_rotary_mul(k.unsqueeze(0), cos4, sin4).squeeze(0)
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, qkv[:, (nh + nkv) * hd :].reshape(n, nkv, hd))

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(self.npu.npu_swiglu(gate_up, dim=-1))

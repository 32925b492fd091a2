"""``TritonLayerOps``: the layer-ops interface of ``kernels/layer_ops.py`` on Triton kernels.

Chosen on CUDA by default once the kernels pass a self-check on the device
(``kernels/triton/backend.py``); ``TorchLayerOps`` where they fail it. They are tested on the CPU
under the interpreter, and compiled for sm_90 without a GPU.
"""

from __future__ import annotations

import torch

from fusedserve.kernels.layer_ops import NormScratch
from fusedserve.kernels.triton import layer_kernels as k


class TritonLayerOps:
    def __init__(self, eps: float, heads: int, kv_heads: int):
        self.eps, self.heads, self.kv_heads = eps, heads, kv_heads

    def add_rms_norm(self, x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor,
                     out: torch.Tensor, buf: NormScratch) -> None:
        k.add_rms_norm(x, add, weight, self.eps, out)

    def qk_norm_rope(self, qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor, q_out: torch.Tensor, buf: NormScratch,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        k.qk_norm_rope(qkv, q_weight, k_weight, cos, sin, self.eps, q_out, self.heads, self.kv_heads,
                       k_cache, v_cache, slot_mapping)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        k.silu_mul(gate_up, out)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> None:
        k.apply_token_bitmask(logits, bitmask)

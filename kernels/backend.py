"""The kernels a model runs, chosen once at load: the model itself has no backend branches.

On the CPU with the native build (``kernels/native.py``): the native linear, fused norms and
paged decode attention. Elsewhere (CUDA, Ascend, a CPU without a compiler): ATen's ops
with the vendors' int8 matmuls. Triton kernels on CUDA (``FUSEDSERVE_TRITON=1``) and torch_npu's
fused ops on Ascend (``FUSEDSERVE_ASCEND_FUSED=1``) are further kinds of the same objects, opt-in
until a run on their hardware has checked them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType

import torch

from kernels import ascend as ascend_kernels
from kernels import native as native_build
from kernels import triton as triton_kernels
from kernels.attention import AttentionBackend
from kernels.attention.native import NativeAttention
from kernels.attention.torch_gather import AttentionScratch, TorchAttention
from kernels.layer_ops import NativeLayerOps, TorchLayerOps
from kernels.linear import LinearOp
from kernels.model.config import Qwen3Config


@dataclass
class Kernels:
    config: Qwen3Config
    dtype: torch.dtype
    device: torch.device
    linear: LinearOp
    ops: NativeLayerOps | TorchLayerOps  # or TritonLayerOps (kernels/triton/), AscendLayerOps (ascend/)
    native: ModuleType | None  # the native CPU build, where it runs
    triton: bool = False  # the Triton layer ops and paged decode attention (kernels/triton/)
    # A MoE layer's experts as two grouped GEMMs (torch._grouped_mm) over tokens sorted by expert on
    # the device, where this device and dtype run it (CUDA, bf16); else one GEMM per expert.
    grouped_moe: bool = False
    ascend: bool = False  # torch_npu's fused layer ops and attention (kernels/ascend/)

    @property
    def capturable(self) -> bool:
        """Whether a device graph can capture a forward (the Ascend attention reads lengths on the host)."""
        return not self.ascend

    @property
    def attention_name(self) -> str:
        if self.native is not None:
            return f"native-{self.native.isa()}"
        if self.ascend:
            return "npu-fused-infer-attention"
        return "triton-paged" if self.triton else "aten-gather"

    def new_attention(self, max_batch: int, max_ctx: int, block_size: int) -> AttentionBackend:
        """An attention backend with its own scratch (one per workspace)."""
        c, scale = self.config, self.config.head_dim ** -0.5
        if self.native is not None:
            return NativeAttention(self.native, scale)
        if self.ascend:
            from kernels.ascend.attention import AscendAttention

            return AscendAttention(c.num_attention_heads, c.num_key_value_heads, c.head_dim, scale,
                                   self.device)
        if self.triton:
            from kernels.triton.attention import TritonAttention

            return TritonAttention(max_batch, max_ctx, c.num_attention_heads, c.head_dim, scale, self.device)
        scratch = AttentionScratch(max_batch, max_ctx, c.num_attention_heads, c.num_key_value_heads,
                                   c.head_dim, block_size, self.dtype, self.device)
        return TorchAttention(scratch, scale)


def select_kernels(config: Qwen3Config, dtype: torch.dtype, device: torch.device,
                   int8_activations: bool = True) -> Kernels:
    """``int8_activations``: int8 weights multiply with int8 activations where the build can."""
    native = native_build.kernels() if device.type == "cpu" else None
    c = config
    if native is not None:
        ops = NativeLayerOps(native, c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads)
    elif device.type == "cuda" and os.environ.get("FUSEDSERVE_TRITON") == "1" and triton_kernels.available():
        # Opt-in until a GPU run has checked the Triton kernels compiled (kernels/triton/).
        from kernels.triton.layer_ops import TritonLayerOps

        ops = TritonLayerOps(c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads)
        return Kernels(config, dtype, device, LinearOp(device, native, dtype, int8_activations), ops, native,
                       triton=True, grouped_moe=_grouped_mm_runs(c, device, dtype))
    elif (device.type == "npu" and os.environ.get("FUSEDSERVE_ASCEND_FUSED") == "1"
          and ascend_kernels.available()):
        # Opt-in until an NPU run has checked torch_npu's fused ops in these roles (kernels/ascend/).
        from kernels.ascend.layer_ops import AscendLayerOps

        ops = AscendLayerOps(c.rms_norm_eps, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                             c.head_dim, device)
        return Kernels(config, dtype, device, LinearOp(device, native, dtype, int8_activations), ops, native,
                       ascend=True)
    else:
        ops = TorchLayerOps(c.rms_norm_eps, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                            c.head_dim, device)
    return Kernels(config, dtype, device, LinearOp(device, native, dtype, int8_activations), ops, native,
                   grouped_moe=_grouped_mm_runs(c, device, dtype))


def _grouped_mm_runs(c: Qwen3Config, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a MoE model here takes the grouped-GEMM path: on CUDA, where a probe of
    ``torch._grouped_mm`` in this dtype runs (bf16 on sm90 and later). The CPU keeps its native
    per-expert GEMMs, which read only the experts a token routes to."""
    if not c.num_experts or device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        x = torch.ones(16, 64, dtype=dtype, device=device)
        w = torch.ones(2, 32, 64, dtype=dtype, device=device)
        offs = torch.tensor([8, 16], dtype=torch.int32, device=device)
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        return True
    except (RuntimeError, NotImplementedError):
        return False

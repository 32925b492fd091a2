"""The Ascend backend (NPU, opt-in with ``FUSEDSERVE_ASCEND_FUSED=1`` until an NPU run has checked
it): torch_npu's fused ops in the layer roles and one fused attention call per layer
(``kernels/ascend/``). Its attention reads the lengths on the host, so no NPU graph captures it.
Importable without torch_npu, which is imported only when chosen."""

from __future__ import annotations

import os

import torch

from fusedserve.kernels import ascend as ascend_kernels
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.native.gemm_choice import GemmChooser
from fusedserve.kernels.sampler import Sampler, sample

NAME = "ascend"
CAPTURABLE = False


def usable(device: torch.device) -> bool:
    return (device.type == "npu" and os.environ.get("FUSEDSERVE_ASCEND_FUSED") == "1"
            and ascend_kernels.available())


def token_sampler() -> Sampler:
    return sample


def attention_name() -> str:
    return "npu-fused-infer-attention"


def layer_ops(c: Qwen3Config, device: torch.device):
    from fusedserve.kernels.ascend.layer_ops import AscendLayerOps

    return AscendLayerOps(c.rms_norm_eps, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                          c.head_dim, device)


def attention(c: Qwen3Config, dtype: torch.dtype, device: torch.device, max_batch: int, max_ctx: int,
              block_size: int, kv_cache_dtype: str = "auto", chooser: GemmChooser | None = None):
    from fusedserve.kernels.ascend.attention import AscendAttention

    return AscendAttention(c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.head_dim ** -0.5,
                           device)

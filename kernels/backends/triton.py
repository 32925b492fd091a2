"""The Triton backend (CUDA, opt-in with ``FUSEDSERVE_TRITON=1`` until a GPU run has checked it
compiled): the layer kernels and the paged attention of ``kernels/triton/``. Importable without
triton; its kernels are imported only when chosen."""

from __future__ import annotations

import os

import torch

from kernels import triton as triton_kernels
from kernels.model.config import Qwen3Config

NAME = "triton"
CAPTURABLE = True


def usable(device: torch.device) -> bool:
    return device.type == "cuda" and os.environ.get("FUSEDSERVE_TRITON") == "1" and triton_kernels.available()


def attention_name() -> str:
    return "triton-paged"


def layer_ops(c: Qwen3Config, device: torch.device):
    from kernels.triton.layer_ops import TritonLayerOps

    return TritonLayerOps(c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads)


def attention(c: Qwen3Config, dtype: torch.dtype, device: torch.device, max_batch: int, max_ctx: int,
              block_size: int):
    from kernels.triton.attention import TritonAttention

    return TritonAttention(max_batch, max_ctx, c.num_attention_heads, c.head_dim, c.head_dim ** -0.5, device)

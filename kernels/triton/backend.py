"""The Triton backend (CUDA): the layer kernels and the paged attention of ``kernels/triton/``,
whose decode attention reads only what each row holds (ATen's graphs gather the padded table
width). The default on CUDA once its kernels pass a self-check on the device
(``kernels/triton/self_check.py``, once per device); a failed check warns and leaves ATen.
``FUSEDSERVE_TRITON=1`` forces it, ``=0`` turns it off. Importable without triton; its kernels
are imported only when chosen."""

from __future__ import annotations

import functools
import logging
import os

import torch

from fusedserve.kernels import triton as triton_kernels
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.native.gemm_choice import GemmChooser

NAME = "triton"
CAPTURABLE = True


log = logging.getLogger(__name__)


def usable(device: torch.device) -> bool:
    if device.type != "cuda" or not triton_kernels.available():
        return False
    flag = os.environ.get("FUSEDSERVE_TRITON", "").strip()
    if flag in ("0", "1"):
        return flag == "1"
    return passes_self_check(str(torch.device(device.type, device.index or 0)))


@functools.cache
def passes_self_check(device: str) -> bool:
    """Whether the kernels agree with torch on ``device`` (checked once per device)."""
    from fusedserve.kernels.triton.self_check import check

    failed = check(torch.device(device))
    if failed:
        log.warning("the Triton kernels failed their self-check on %s (%s): using ATen's kernels "
                    "(FUSEDSERVE_TRITON=1 forces Triton)", device, failed)
    return failed is None


def token_sampler():
    """The every-stage sampler in a few Triton kernels (``kernels/triton/sampler.py``): ATen's
    takes ~290 ops, which would double a sampled decode step."""
    from fusedserve.kernels.triton.sampler import sample

    return sample


def attention_name() -> str:
    return "triton-paged"


def layer_ops(c: Qwen3Config, device: torch.device):
    from fusedserve.kernels.triton.layer_ops import TritonLayerOps

    return TritonLayerOps(c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads)


def attention(c: Qwen3Config, dtype: torch.dtype, device: torch.device, max_batch: int, max_ctx: int,
              block_size: int, kv_cache_dtype: str = "auto", chooser: GemmChooser | None = None):
    from fusedserve.kernels.triton.attention import TritonAttention

    return TritonAttention(max_batch, max_ctx, c.num_attention_heads, c.head_dim, c.head_dim ** -0.5, device)

"""The kernels a model runs, chosen once at load by one lookup: the model has no backend branches.

One module per backend (``native``, ``aten``, ``triton``, ``ascend``), each exporting its
``NAME``, whether a device graph may capture it (``CAPTURABLE``), ``usable(device)``, its layer
ops (``LayerOps``), its attention (``AttentionBackend``, built per workspace and cache dtype,
given the GEMM chooser to measure its prompt kernel where it has a choice), its sampler
(``token_sampler()``) and the name stats report for it. The linear (``kernels/linear.py``) is
chosen per weight kind beside it.

The choice: on the CPU, ``native`` where the native build runs; on CUDA, ``triton`` where its
kernels pass a self-check on the device (``FUSEDSERVE_TRITON=1`` forces it, ``=0`` keeps ATen);
on Ascend, ``ascend`` with ``FUSEDSERVE_ASCEND_FUSED=1`` (opt-in until a run on that hardware has
checked it); else ``aten``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from fusedserve.kernels.ascend import backend as ascend
from fusedserve.kernels.aten import backend as aten
from fusedserve.kernels.attention import AttentionBackend
from fusedserve.kernels.layer_ops import LayerOps
from fusedserve.kernels.linear import LinearOp
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.native import backend as native
from fusedserve.kernels.native import build as native_build
from fusedserve.kernels.sampler import Sampler
from fusedserve.kernels.triton import backend as triton

BACKENDS: dict[str, ModuleType] = {m.NAME: m for m in (native, aten, triton, ascend)}
PREFERRED = {"cpu": native, "cuda": triton, "npu": ascend}  # where usable; aten otherwise


def backend_for(device: torch.device) -> ModuleType:
    preferred = PREFERRED.get(device.type)
    return preferred if preferred is not None and preferred.usable(device) else aten


@dataclass
class Kernels:
    config: Qwen3Config
    dtype: torch.dtype
    device: torch.device
    backend: ModuleType  # one of BACKENDS
    linear: LinearOp
    ops: LayerOps
    sample: Sampler  # logits -> token ids (``kernels.sampler.sample``'s contract)
    # A MoE layer's experts as two grouped GEMMs (torch._grouped_mm) over tokens sorted by expert on
    # the device, where this device and dtype run it (CUDA, bf16); else one GEMM per expert.
    grouped_moe: bool = False
    # KV cache dtype -> the fewest query rows of a prompt chunk SDPA takes where it measured
    # faster than the native flash kernel (AMX-BF16 through oneDNN's brgemm on such CPUs).
    sdpa_from: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.backend.NAME

    @property
    def capturable(self) -> bool:
        """Whether a device graph can capture a forward."""
        return self.backend.CAPTURABLE

    @property
    def attention_name(self) -> str:
        """The attention kernel, and from how many rows SDPA takes prompt chunks where it does."""
        name = self.backend.attention_name()
        for cache, rows in sorted(self.sdpa_from.items()):
            name += f" + sdpa-{'int8' if cache == 'int8' else 'bf16'}-cache prompts from {rows} rows"
        return name

    def new_attention(self, max_batch: int, max_ctx: int, block_size: int,
                      kv_cache_dtype: str = "auto") -> AttentionBackend:
        """An attention backend with its own scratch (one per workspace), for a cache of
        ``kv_cache_dtype``; its prompt kernel chosen by the linear's chooser where it measures."""
        attention = self.backend.attention(self.config, self.dtype, self.device, max_batch, max_ctx,
                                           block_size, kv_cache_dtype, self.linear.chooser)
        rows = getattr(attention, "sdpa_from", None)
        if rows is not None:
            self.sdpa_from[kv_cache_dtype] = rows
        return attention


def select_kernels(config: Qwen3Config, dtype: torch.dtype, device: torch.device,
                   int8_activations: bool = True, gemm: str = "auto") -> Kernels:
    """``int8_activations``: int8 weights multiply with int8 activations where the build can.
    ``gemm``: ``auto`` lets a matrix-engine GEMM run the row buckets where it measured faster on
    this CPU (``kernels/native/gemm_choice.py``); ``native`` keeps the native kernels everywhere."""
    backend = backend_for(device)
    build = native_build.kernels() if device.type == "cpu" else None
    linear = LinearOp(device, build, dtype, int8_activations, gemm)
    return Kernels(config, dtype, device, backend, linear, backend.layer_ops(config, device),
                   backend.token_sampler(), grouped_moe=_grouped_mm_runs(config, device, dtype))


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

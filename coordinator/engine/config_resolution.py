"""An ``EngineConfig`` resolved once, before anything is sized: the model's directory, its
context length, its dtype and quantization as every worker will load them.

The server and the offline engine both resolve here; the worker actors receive the result and
decide nothing of it again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from coordinator.model_files.default_model import resolve_model
from kernels.model.config import Qwen3Config, parse_dtype
from kernels.model.qwen3 import resolve_dtype
from kernels.quantize import check_quantization
from shared_memory.engine_config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedEngine:
    config: EngineConfig  # every field concrete: model a directory, max_model_len and dtype set
    model: Qwen3Config


def resolve_config(cfg: EngineConfig, device_kind: str) -> ResolvedEngine:
    """``device_kind``: the probed device (cpu, cuda, npu), which decides ``dtype="auto"``."""
    cfg.check()
    quantization = check_quantization(cfg.model.quantization)
    model_dir = str(resolve_model(cfg.model.model))
    model = Qwen3Config.from_dir(model_dir)
    limit = model.max_context  # YaRN's stretched window where the config has one
    max_len = cfg.model.max_model_len or limit
    if max_len > limit:
        log.warning("max_model_len %d exceeds the model's context %d: using %d",
                    max_len, limit, limit)
        max_len = limit
    dtype = resolve_dtype(cfg.model.dtype, parse_dtype(model.dtype), device_kind)
    resolved = cfg.replace(model=model_dir, max_model_len=max_len, quantization=quantization,
                           dtype=dtype_name(dtype))
    return ResolvedEngine(resolved, model)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

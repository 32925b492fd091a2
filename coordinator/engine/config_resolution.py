"""An ``EngineConfig`` resolved once, before anything is sized: the model's directory, its
context length, its dtype and quantization as every worker will load them.

The server and the offline engine both resolve here; the worker actors receive the result and
decide nothing of it again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fusedserve.coordinator.engine import kv_sizing
from fusedserve.coordinator.engine.kv_sizing import KVPlan
from fusedserve.coordinator.engine.pooling_resolution import resolve_pooling
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.kernels.model_description.checkpoint_format import checkpoint_format, parameter_count
from fusedserve.kernels.model_description.config import Qwen3Config, parse_dtype, resolve_dtype
from fusedserve.kernels.model_description.lora import slot_bytes
from fusedserve.kernels.model_description.quantization import check_quantization
from fusedserve.shared_memory.engine_config import EngineConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedEngine:
    config: EngineConfig  # every field concrete: model a directory, max_model_len, dtype, blocks set
    model: Qwen3Config
    kv: KVPlan  # what the KV cache holds, for the startup line
    parameters: int  # the checkpoint's, for the startup line


def resolve_config(cfg: EngineConfig, device_kind: str, ranks_on_node: int = 1) -> ResolvedEngine:
    """``device_kind``: the probed device (cpu, cuda, npu), which decides ``dtype="auto"`` and the KV
    budget; ``ranks_on_node``: the worker ranks sharing this node's memory."""
    cfg.check()
    quantization = check_quantization(cfg.model.quantization)
    m = cfg.model
    model_dir = str(resolve_model(m.model, m.revision, m.download_dir))
    model = Qwen3Config.from_dir(model_dir)
    fmt = checkpoint_format(model_dir)
    if quantization == "fp8":  # vLLM's name: an FP8 checkpoint's own path, else 8-bit weights as int8
        quantization = None if fmt.method == "fp8" else "int8"
    # A quantized checkpoint decides (or refuses) the quantization; an unknown format is refused.
    quantization = fmt.quantization(quantization, device_kind)
    limit = model.max_context  # YaRN's stretched window where the config has one
    max_len = m.max_model_len
    if max_len is not None and max_len > limit and m.allow_long_max_model_len:
        log.warning("max_model_len %d exceeds the model's context %d (allowed: --allow-long-max-model-len); "
                    "positions past it may give wrong outputs", max_len, limit)
    elif max_len is not None and max_len > limit:
        log.warning("max_model_len %d exceeds the model's context %d: using %d", max_len, limit, limit)
        max_len = limit
    dtype = resolve_dtype(m.dtype, parse_dtype(model.dtype), device_kind)
    c, p = cfg.cache, cfg.parallel
    if model.hybrid:
        cfg = hybrid_settings(cfg)
    cfg = resolve_pooling(cfg, model_dir, model)
    if c.kv_cache_dtype == "int8" and device_kind != "cpu":
        raise ValueError(f"kv_cache_dtype int8 runs on the native CPU kernels; this engine's device is "
                         f"{device_kind}: use kv_cache_dtype auto there")
    lo = cfg.lora  # the adapter slots are allocated beside the weights
    loras = lo.max_loras * slot_bytes(model, lo.max_lora_rank, dtype.itemsize) if lo.enable_lora else 0
    kv = kv_sizing.plan(model, dtype, cfg.cache, device_kind=device_kind, max_batch=cfg.scheduler.max_batch,
                        max_model_len=max_len, weight_bytes=kv_sizing.weight_bytes(model_dir) + loras,
                        ranks_on_node=ranks_on_node, tp=p.tensor_parallel_size)
    resolved = cfg.replace(model=model_dir, max_model_len=kv.max_model_len, quantization=quantization,
                           dtype=dtype_name(dtype), num_blocks=kv.num_blocks,
                           speculative_model=_draft_dir(cfg, model))
    return ResolvedEngine(resolved, model, kv, parameter_count(model_dir))


def hybrid_settings(cfg: EngineConfig) -> EngineConfig:
    """A hybrid model (Gated DeltaNet layers) runs with a recurrent-state slot per request and,
    with prefix caching, a snapshot slot per request (its state at its last block boundary);
    speculating requests keep the state of their accepted tokens (``HybridKVCache.keep_accepted``).
    A hybrid draft model is refused (``_draft_dir``)."""
    snapshots = cfg.scheduler.max_batch if cfg.cache.enable_prefix_caching else 0
    return cfg.replace(recurrent_state=True, state_snapshots=snapshots)


def _draft_dir(cfg: EngineConfig, target: Qwen3Config) -> str | None:
    """The draft model's directory, refused unless it shares the target's vocabulary."""
    name = cfg.speculative.speculative_model
    if name is None:
        return None
    m = cfg.model
    path = str(resolve_model(name, None, m.download_dir))
    draft = Qwen3Config.from_dir(path)
    if draft.hybrid:
        raise ValueError(f"the draft model {name!r} is a hybrid (Gated DeltaNet) model: a draft must be a "
                         "Qwen3 model (its states are not rolled back when proposals are rejected)")
    vocab = draft.vocab_size
    if vocab != target.vocab_size:
        raise ValueError(f"the draft model {name!r} has a vocabulary of {vocab}, the target "
                         f"{target.vocab_size}: a draft must share the target's tokenizer")
    return path


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

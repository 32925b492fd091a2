"""How many KV blocks a worker gets, and how long a sequence may be, from the memory at hand.

A worker's KV budget is ``--kv-cache-memory`` bytes if given; else, on a GPU the coordinator sees,
``--gpu-memory-utilization`` of its memory less the weights' share and a reserve for activations;
else (the CPU) ``CPU_KV_SHARE`` of the memory this process may still use (the cgroup's limit or the
node's available memory) split among the node's workers and ranks. ``--num-blocks`` overrides all.
Blocks beyond what ``max_batch`` sequences of ``max_model_len`` tokens could ever hold are not
allocated. A context the budget cannot hold once is refused when asked for, and cut to what fits
(stated) when it is the model's own default.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from fusedserve.kernels.model_description.checkpoint_format import checkpoint_format
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.model_description.kv_layout import kv_element
from fusedserve.shared_memory.engine_config import CacheConfig

log = logging.getLogger(__name__)

CPU_KV_SHARE = 0.4  # of the memory left to this process, across the node's workers
GPU_ACTIVATION_RESERVE = 0.1  # of a GPU's memory, kept for activations and graphs


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    source: str  # where the budget came from, for the startup line
    kv_cache_dtype: str = "auto"
    # A hybrid's recurrent states: bytes per sequence, and the slots held (max_batch and a spare).
    state_bytes: int = 0
    state_slots: int = 0

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Sequences of max_model_len tokens the cache holds at once (vLLM's startup figure)."""
        return self.tokens / self.max_model_len

    def describe(self) -> str:
        gib = self.num_blocks * self.bytes_per_block / (1 << 30)
        kind = "" if self.kv_cache_dtype == "auto" else f" ({self.kv_cache_dtype})"
        states = ""
        if self.state_bytes:
            states = (f"; recurrent states: {self.state_bytes / (1 << 20):.2f} MiB per sequence x "
                      f"{self.state_slots} slots = "
                      f"{self.state_bytes * self.state_slots / (1 << 30):.2f} GiB, "
                      f"{self.bytes_per_block // self.block_size} bytes per token in the attention layers")
        return (f"KV cache{kind}: {self.num_blocks} blocks x {self.block_size} tokens = {self.tokens} "
                f"tokens per worker ({gib:.2f} GiB, {self.source}){states}; maximum concurrency for "
                f"{self.max_model_len} tokens per request: {self.max_concurrency:.2f}x")


def bytes_per_token(model: Qwen3Config, dtype: torch.dtype, tp: int, kv_cache_dtype: str = "auto") -> int:
    """K and V of every attention layer (a hybrid's full-attention ones) for one token on one rank
    (KV heads split, or replicated past them); an int8 cache's rows hold a byte per value and a
    4-byte scale."""
    kv_heads = max(1, math.ceil(model.num_key_value_heads / tp))
    element, extra = kv_element(dtype, kv_cache_dtype)
    return len(model.attention_layers) * 2 * kv_heads * (model.head_dim + extra) * element.itemsize


def memory_left() -> int:
    """Bytes this process may still allocate: the node's available memory, or less under a cgroup limit."""
    avail = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            avail = min(avail or 1 << 62, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(avail, 0)


def _budget(kv_memory: int | None, gpu_util: float, device_kind: str, weight_bytes: int,
            ranks_on_node: int, tp: int) -> tuple[int, str]:
    """One rank's KV bytes. A GPU holds one rank: its share of the weights (1/tp of them)."""
    if kv_memory is not None:
        return kv_memory, "--kv-cache-memory"
    if device_kind == "cuda" and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        left = int(total * (gpu_util - GPU_ACTIVATION_RESERVE)) - weight_bytes // max(tp, 1)
        return max(left, 0), f"{gpu_util:.0%} of the GPU's {total / (1 << 30):.0f} GiB less weights"
    share = int(CPU_KV_SHARE * memory_left()) // max(ranks_on_node, 1)
    return share, f"{CPU_KV_SHARE:.0%} of this host's available memory over {ranks_on_node} worker ranks"


def plan(model: Qwen3Config, dtype: torch.dtype, cache: CacheConfig, *, device_kind: str, max_batch: int,
         max_model_len: int | None, weight_bytes: int, ranks_on_node: int, tp: int) -> KVPlan:
    """The worker's blocks and the context length, or ValueError naming what does not fit.
    ``cache`` as asked (its blocks, or the memory to size them from); ``max_model_len`` None: the
    model's own context; ``weight_bytes``: the checkpoint's, which a GPU's share leaves out."""
    block_size, num_blocks, kv_cache_dtype = cache.block_size, cache.num_blocks, cache.kv_cache_dtype
    kv_memory, gpu_util = cache.kv_cache_memory, cache.gpu_memory_utilization
    per_block = bytes_per_token(model, dtype, tp, kv_cache_dtype) * block_size
    # A hybrid's states: a slot per running request, a spare, and the snapshots of prefix caching.
    states = max_batch + 1 + cache.state_snapshots if model.hybrid else 0
    context = max_model_len or model.max_context
    if num_blocks is not None:
        blocks, source = num_blocks, "--num-blocks"
    else:
        budget, source = _budget(kv_memory, gpu_util, device_kind, weight_bytes, ranks_on_node, tp)
        budget -= model.state_bytes(dtype) // tp * states  # a hybrid's states (its heads' share) first
        if model.hybrid:
            source += f", less {states} recurrent states"
        blocks = min(max(budget, 0) // per_block, max_batch * -(-context // block_size))
    if blocks * block_size < context:
        if max_model_len is not None or blocks < 1:
            raise ValueError(
                f"the KV cache holds {blocks * block_size} tokens per worker ({source}), fewer than one "
                f"sequence of max_model_len {context}: give it more memory (--kv-cache-memory, "
                f"--gpu-memory-utilization, --num-blocks) or a shorter --max-model-len")
        log.warning("the model's context of %d tokens does not fit the KV cache (%d tokens per worker, %s): "
                    "max_model_len is %d; for the whole context give the cache more memory "
                    "(--kv-cache-memory, --gpu-memory-utilization)", context, blocks * block_size, source,
                    blocks * block_size)
        context = blocks * block_size
    return KVPlan(blocks, block_size, per_block, context, source, kv_cache_dtype,
                  model.state_bytes(dtype) // tp, states)


def weight_bytes(model_dir: str) -> int:
    """The checkpoint's size on disk (what the workers hold, before any quantization): its
    safetensors, or the GGUF file a sidecar directory names."""
    files = list(Path(model_dir).glob("*.safetensors"))
    fmt = checkpoint_format(model_dir)
    if fmt.method == "gguf":
        files.append(Path(fmt.file))
    return sum(p.stat().st_size for p in files)

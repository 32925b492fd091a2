"""The worker's LoRA adapter slots: device memory allocated once, adapters read into it on demand.

``--max-loras`` slots, each holding one adapter's A and B for every layer and fused projection at
rank ``--max-lora-rank`` (an adapter of a lower rank fills the leading rows and columns; the rest
stay zero). Loading an adapter copies it into its slot's part of these tensors: nothing is
allocated on the device after start, and the model's slot views (``Qwen3Model.set_lora``) keep
pointing at the same memory. Adapters read from disk are kept in host memory, least recently used
dropped first, up to ``--max-cpu-loras``, so an adapter evicted from its slot comes back without
reading its file again. The coordinator decides which adapter goes in which slot (the launch's
``lora_loads``); this only carries it out.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from fusedserve.kernels.model_description.lora import LoraAdapter
from fusedserve.shared_memory.engine_config import LoraConfig
from fusedserve.worker.model.lora_weights import FUSED, LoraPart, LoraProjection, LoraWeights, load_lora
from fusedserve.worker.model.qwen3 import Qwen3Model

log = logging.getLogger(__name__)


class LoraPool:
    def __init__(self, model: Qwen3Model, lora: LoraConfig):
        self.model = model
        self.rank = lora.max_lora_rank
        self.max_cpu = lora.max_cpu_loras or lora.max_loras
        c, n, r = model.config, lora.max_loras, lora.max_lora_rank
        layers = c.num_hidden_layers
        self.a: dict[str, torch.Tensor] = {}  # fused projection -> [layers, slots, parts * rank, in]
        self.b: dict[str, torch.Tensor] = {}  # fused projection -> [layers, slots, out, rank]
        for fused, modules in FUSED.items():
            fan_in, fan_out = _local_dims(model, fused)
            kw = {"dtype": model.dtype, "device": model.device}
            self.a[fused] = torch.zeros(layers, n, len(modules) * r, fan_in, **kw)
            self.b[fused] = torch.zeros(layers, n, fan_out, r, **kw)
        self.keys: list[str | None] = [None] * n  # what each slot holds
        self.host: OrderedDict[str, LoraWeights] = OrderedDict()  # read adapters, least recent first
        for slot in range(n):
            model.set_lora(slot, None)
        log.info("LoRA: %d adapter slots of rank %d, %.1f MiB", n, r, self.nbytes / (1 << 20))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a.values(), *self.b.values()))

    def load(self, loads: list[list]) -> int:
        """Read each ``[slot, key, path]`` into its slot; the bytes copied to the device."""
        moved = 0
        for slot, key, path in loads:
            weights = self._read(key, path)
            moved += self._fill(slot, weights)
            self.keys[slot] = key
            log.info("LoRA adapter %s read into slot %d", key, slot)
        return moved

    def _read(self, key: str, path: str) -> LoraWeights:
        """The adapter in host memory (this rank's share, the model's dtype), read once while kept."""
        weights = self.host.pop(key, None)
        if weights is None:
            m = self.model
            name = key.rpartition("#")[0]
            adapter = LoraAdapter.from_dir(name, path, self.rank, m.config.num_hidden_layers)
            weights = load_lora(adapter, m.config, m.dtype, torch.device("cpu"), m.tp)
        self.host[key] = weights
        while len(self.host) > self.max_cpu:
            self.host.popitem(last=False)
        return weights

    def _fill(self, slot: int, weights: LoraWeights) -> int:
        """Copy ``weights`` into ``slot`` and point the model's slot at its views."""
        r, moved = self.rank, 0
        for fused in FUSED:
            self.a[fused][:, slot].zero_()
            self.b[fused][:, slot].zero_()
        layers: list[dict[str, LoraProjection]] = []
        for i, layer in enumerate(weights.layers):
            views = {}
            for fused, proj in layer.items():
                a, b = self.a[fused][i, slot], self.b[fused][i, slot]
                parts = []
                for k, part in enumerate(proj.parts):
                    rank = part.b.shape[1]
                    a[k * r : k * r + rank].copy_(proj.a[part.cols])
                    b[part.rows, :rank].copy_(part.b)
                    moved += proj.a[part.cols].nbytes + part.b.nbytes
                    parts.append(LoraPart(part.rows, slice(k * r, k * r + rank), b[part.rows, :rank]))
                views[fused] = LoraProjection(a[: len(parts) * r], parts)
            layers.append(views)
        self.model.set_lora(slot, LoraWeights(weights.adapter, layers))
        return moved


def _local_dims(model: Qwen3Model, fused: str) -> tuple[int, int]:
    """(in, out) of this rank's share of fused projection ``fused``."""
    c, tp = model.config, model.tp
    hd = c.head_dim
    q = len(tp.heads(c)) * hd
    kv = len(tp.kv_heads(c)) * hd
    inter = len(tp.split(c.intermediate_size))
    dims = {"qkv": (c.hidden_size, q + 2 * kv), "o_proj": (q, c.hidden_size),
            "gate_up": (c.hidden_size, 2 * inter), "down": (inter, c.hidden_size)}
    return dims[fused]

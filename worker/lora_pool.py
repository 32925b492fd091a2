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
from fusedserve.kernels.native import build as native_build
from fusedserve.shared_memory.engine_config import LoraConfig
from fusedserve.worker.model.lora_weights import FUSED, LoraPart, LoraProjection, LoraWeights, load_lora
from fusedserve.worker.model.qwen3 import Qwen3Model

log = logging.getLogger(__name__)
NATIVE_MAX_RANK = 64  # the native kernel keeps a block of B (rank x vector lanes) on its stack


class LoraPool:
    def __init__(self, model: Qwen3Model, lora: LoraConfig, max_tokens: int = 0):
        """``max_tokens``: the most tokens a launch carries (the Triton kernels' scratch)."""
        self.model = model
        self.rank = lora.max_lora_rank
        self.max_cpu = lora.max_cpu_loras or lora.max_loras
        c, n, r = model.config, lora.max_loras, lora.max_lora_rank
        layers, kw = c.num_hidden_layers, {"dtype": model.dtype, "device": model.device}
        # Per fused projection: part j's A in rows j * rank.. of a slot's A; B transposed (one rank row
        # of every output column), so that a slot's update streams B in memory order; whether a slot's
        # adapter changes the projection in each layer.
        self.a: dict[str, torch.Tensor] = {}  # [layers, slots, parts * rank, in]
        self.bt: dict[str, torch.Tensor] = {}  # [layers, slots, rank, out]
        self.active: dict[str, torch.Tensor] = {}  # [layers, slots] uint8
        self.parts: dict[str, list[int]] = {}  # each part's first output column, then the width
        for fused, modules in FUSED.items():
            fan_in, widths = _local_dims(model, fused)
            self.a[fused] = torch.zeros(layers, n, len(modules) * r, fan_in, **kw)
            self.bt[fused] = torch.zeros(layers, n, r, sum(widths), **kw)
            self.active[fused] = torch.zeros(layers, n, dtype=torch.uint8, device=model.device)
            self.parts[fused] = [sum(widths[:j]) for j in range(len(widths) + 1)]
        self.host: OrderedDict[str, LoraWeights] = OrderedDict()  # read adapters, least recent first
        for slot in range(n):
            model.set_lora(slot, None)
        # The native CPU kernel applies every slot of a projection in one call, the Triton kernels
        # (CUDA) every token's in two launches; elsewhere the torch path (kernels/lora.py) over the
        # slots' views.
        self._native = native_build.kernels() if model.kernels.name == "native" else None
        if self._native is not None and hasattr(self._native, "lora_apply") and r <= NATIVE_MAX_RANK:
            model.lora_apply = self.apply
        elif model.kernels.name == "triton" and max_tokens:
            from fusedserve.kernels.triton.lora import lora_apply as triton_lora

            self._triton = triton_lora
            self._u = torch.empty(max_tokens, 3 * r, dtype=torch.float32, device=model.device)
            model.lora_apply = self.apply_triton
        log.info("LoRA: %d adapter slots of rank %d, %.1f MiB", n, r, self.nbytes / (1 << 20))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.a.values(), *self.bt.values()))

    def apply(self, layer: int, fused: str, slots: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> None:
        """``y[t] += B A x[t]`` with token ``t``'s slot's adapter (native: one call for every slot)."""
        self._native.lora_apply(x, y, slots, self.a[fused][layer], self.bt[fused][layer], self.parts[fused],
                                self.active[fused][layer])

    def apply_triton(self, layer: int, fused: str, slots: torch.Tensor, x: torch.Tensor,
                     y: torch.Tensor) -> None:
        self._triton(x, y, slots, self.a[fused][layer], self.bt[fused][layer], self.parts[fused],
                     self.active[fused][layer], self._u)

    def load(self, loads: list[list]) -> int:
        """Read each ``[slot, key, path]`` into its slot; the bytes copied to the device."""
        moved = 0
        for slot, key, path in loads:
            weights = self._read(key, path)
            moved += self._fill(slot, weights)
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
            self.bt[fused][:, slot].zero_()
            self.active[fused][:, slot] = 0
        layers: list[dict[str, LoraProjection]] = []
        for i, layer in enumerate(weights.layers):
            views = {}
            for fused, proj in layer.items():
                a, bt = self.a[fused][i, slot], self.bt[fused][i, slot]
                starts = self.parts[fused]
                parts = []
                for part in proj.parts:
                    j, rank = starts.index(part.rows.start), part.b.shape[1]
                    a[j * r : j * r + rank].copy_(proj.a[part.cols])
                    bt[:rank, part.rows].copy_(part.b.T)
                    moved += proj.a[part.cols].nbytes + part.b.nbytes
                    parts.append(LoraPart(part.rows, slice(j * r, j * r + rank), bt[:rank, part.rows].T))
                self.active[fused][i, slot] = 1
                views[fused] = LoraProjection(a, parts)
            layers.append(views)
        self.model.set_lora(slot, LoraWeights(weights.adapter, layers))
        return moved


def _local_dims(model: Qwen3Model, fused: str) -> tuple[int, list[int]]:
    """(in, each part's out) of this rank's share of fused projection ``fused``."""
    c, tp = model.config, model.tp
    q = len(tp.heads(c)) * c.head_dim
    kv = len(tp.kv_heads(c)) * c.head_dim
    inter = len(tp.split(c.intermediate_size))
    return {"qkv": (c.hidden_size, [q, kv, kv]), "o_proj": (q, [c.hidden_size]),
            "gate_up": (c.hidden_size, [inter, inter]), "down": (inter, [c.hidden_size])}[fused]

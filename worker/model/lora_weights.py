"""A LoRA adapter's weights in the model's fused layout, this rank's share of them.

The model runs q/k/v as one ``qkv`` projection and gate/up as one ``gate_up``; an adapter has an A
and a B per transformers module. Per fused projection the adapter's A's are stacked (one shrink
``u = x @ A.T`` for all its parts) and each part's B expands its columns of ``u`` into its rows
of the output (punica's SGMV split: shrink once, expand per slice). PEFT's scaling is folded into
B at load.

Tensor parallelism follows the layer's own split: a column-parallel projection (qkv, gate_up)
keeps the whole A and this rank's rows of B; a row-parallel one (o_proj, down) keeps this rank's
columns of A and the whole B, so each rank's update is a partial sum that the layer's existing
all-reduce completes, as it does the projection's (B (A x) is linear in x's shares).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.model_description.lora import TENSOR, WEIGHTS, LoraAdapter, check_fits
from fusedserve.worker.model.tensor_parallel import SINGLE, TensorParallel

# Each fused projection's parts, in the order of its output rows.
FUSED = {"qkv": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}
ROW_PARALLEL = ("o_proj", "down")


@dataclass
class LoraPart:
    """One part's expand: output rows ``rows`` += u[:, cols] @ b.T."""

    rows: slice
    cols: slice
    b: torch.Tensor  # [rows, rank], the adapter's scaling folded in


@dataclass
class LoraProjection:
    a: torch.Tensor  # [sum of the parts' ranks, in]: the parts' A's stacked
    parts: list[LoraPart]


@dataclass
class LoraWeights:
    """An adapter's projections per layer (``layers[i]``: fused name -> its update; a layer or
    projection it leaves alone is absent)."""

    adapter: LoraAdapter
    layers: list[dict[str, LoraProjection]]

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + sum(part.b.nbytes for part in p.parts)
                   for layer in self.layers for p in layer.values())


def load_lora(adapter: LoraAdapter, c: Qwen3Config, dtype: torch.dtype, device: torch.device,
              tp: TensorParallel = SINGLE) -> LoraWeights:
    """``adapter``'s weights for a model of config ``c`` (this rank's share under ``tp``)."""
    check_fits(adapter, c)
    tensors: dict[tuple[int, str, str], torch.Tensor] = {}
    with safe_open(adapter.path + "/" + WEIGHTS, framework="pt") as f:
        for key in f.keys():
            m = TENSOR.match(key)
            tensors[int(m.group(1)), m.group(2), m.group(3)] = f.get_tensor(key).to(torch.float32)
    layers: list[dict[str, LoraProjection]] = []
    for i in range(c.num_hidden_layers):
        layer = {}
        for fused, modules in FUSED.items():
            proj = _projection(adapter, tensors, i, fused, modules, c, tp)
            if proj is not None:
                layer[fused] = LoraProjection(proj.a.to(device, dtype).contiguous(),
                                              [LoraPart(p.rows, p.cols, p.b.to(device, dtype).contiguous())
                                               for p in proj.parts])
        layers.append(layer)
    return LoraWeights(adapter, layers)


def _projection(adapter: LoraAdapter, tensors: dict, i: int, fused: str, modules: tuple[str, ...],
                c: Qwen3Config, tp: TensorParallel) -> LoraProjection | None:
    """One fused projection's update in float32 (None: the adapter leaves it alone)."""
    rows = _rows(c, tp, fused)
    a_parts, parts, row0, col0 = [], [], 0, 0
    for module, share in zip(modules, rows):
        if (i, module, "A") in tensors:
            a, b = tensors[i, module, "A"], tensors[i, module, "B"]
            if fused in ROW_PARALLEL:
                a = a[:, share.start:share.stop]  # this rank's inputs; B whole
            else:
                b = b[share.start:share.stop]  # this rank's outputs; A whole
            a_parts.append(a)
            parts.append(LoraPart(slice(row0, row0 + b.shape[0]), slice(col0, col0 + a.shape[0]),
                                  b * adapter.scaling))
            col0 += a.shape[0]
        row0 += len(share) if fused not in ROW_PARALLEL else c.hidden_size
    if not parts:
        return None
    return LoraProjection(torch.cat(a_parts), parts)


def _rows(c: Qwen3Config, tp: TensorParallel, fused: str) -> list[range]:
    """Each part's share of the weight's split dimension: its output rows for a column-parallel
    projection, its input columns for a row-parallel one."""
    hd = c.head_dim
    if fused == "qkv":
        heads, kv = tp.heads(c), tp.kv_heads(c)
        q = range(heads.start * hd, heads.stop * hd)
        k = range(kv.start * hd, kv.stop * hd)
        return [q, k, k]
    if fused == "o_proj":
        heads = tp.heads(c)
        return [range(heads.start * hd, heads.stop * hd)]
    inter = tp.split(c.intermediate_size)
    return [inter, inter] if fused == "gate_up" else [inter]

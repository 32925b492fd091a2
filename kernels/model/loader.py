"""Hugging Face-layout weight loading: ``model.safetensors`` or a sharded index.

Weights are fused at load time (q/k/v into one matrix, gate/up into another, per expert in a
Qwen3-MoE layer) so the decode step runs one matmul where the checkpoint has three or two.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from kernels.model.config import Qwen3Config


class WeightError(ValueError):
    """A checkpoint is missing a tensor, or a tensor has the wrong shape."""


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor  # [head_dim]
    k_norm: torch.Tensor  # [head_dim]
    o_proj: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in a sparse (MoE) layer
    down: torch.Tensor | None  # [hidden, intermediate]
    router: torch.Tensor | None = None  # [experts, hidden]: a sparse layer's gate
    # A sparse layer's experts: each its (gate_up [2 * moe_intermediate, hidden], down).
    experts: list[tuple[torch.Tensor, torch.Tensor]] | None = None


@dataclass
class Qwen3Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the embedding itself when tied


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors file that holds it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise WeightError(f"{index}: malformed safetensors index: {exc}") from None
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in set(files.values()):
            if not shard.is_file():
                raise WeightError(f"{index}: shard {shard.name} is listed but missing")
        return files
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise WeightError(f"{model_dir}: neither model.safetensors nor an index file found")
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


class _Reader:
    """Reads named tensors lazily, checking shapes, one open file at a time per shard."""

    def __init__(self, model_dir: Path, dtype: torch.dtype):
        self.files = _tensor_files(model_dir)
        self.dtype = dtype
        self.model_dir = model_dir

    def has(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        path = self.files.get(name)
        if path is None:
            raise WeightError(f"{self.model_dir}: missing weight tensor {name!r}")
        with safe_open(str(path), framework="pt") as f:
            tensor = f.get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise WeightError(
                f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        return tensor.to(self.dtype).contiguous()


def load_weights(model_dir: str | Path, config: Qwen3Config, dtype: torch.dtype) -> Qwen3Weights:
    """Read and fuse a Qwen3 checkpoint into ``dtype`` tensors on the CPU."""
    reader = _Reader(Path(model_dir), dtype)
    c = config
    hidden, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        q = reader.get(p + "self_attn.q_proj.weight", (c.q_size, hidden))
        k = reader.get(p + "self_attn.k_proj.weight", (c.kv_size, hidden))
        v = reader.get(p + "self_attn.v_proj.weight", (c.kv_size, hidden))
        bias = None
        if c.attention_bias:
            bias = torch.cat(
                [
                    reader.get(p + "self_attn.q_proj.bias", (c.q_size,)),
                    reader.get(p + "self_attn.k_proj.bias", (c.kv_size,)),
                    reader.get(p + "self_attn.v_proj.bias", (c.kv_size,)),
                ]
            )
        if c.sparse(i):
            gate_up = down = None
            mi = c.moe_intermediate_size
            router = reader.get(p + "mlp.gate.weight", (c.num_experts, hidden))
            experts = []
            for e in range(c.num_experts):
                q_ = f"{p}mlp.experts.{e}."
                experts.append((torch.cat([reader.get(q_ + "gate_proj.weight", (mi, hidden)),
                                           reader.get(q_ + "up_proj.weight", (mi, hidden))]).contiguous(),
                                reader.get(q_ + "down_proj.weight", (hidden, mi))))
        else:
            gate = reader.get(p + "mlp.gate_proj.weight", (inter, hidden))
            up = reader.get(p + "mlp.up_proj.weight", (inter, hidden))
            gate_up = torch.cat([gate, up]).contiguous()
            down = reader.get(p + "mlp.down_proj.weight", (hidden, inter))
            router = experts = None
        layers.append(
            LayerWeights(
                input_norm=reader.get(p + "input_layernorm.weight", (hidden,)),
                qkv=torch.cat([q, k, v]).contiguous(),
                qkv_bias=bias,
                q_norm=reader.get(p + "self_attn.q_norm.weight", (hd,)),
                k_norm=reader.get(p + "self_attn.k_norm.weight", (hd,)),
                o_proj=reader.get(p + "self_attn.o_proj.weight", (hidden, c.q_size)),
                post_norm=reader.get(p + "post_attention_layernorm.weight", (hidden,)),
                gate_up=gate_up,
                down=down,
                router=router,
                experts=experts,
            )
        )
    embed = reader.get("model.embed_tokens.weight", (c.vocab_size, hidden))
    if c.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = reader.get("lm_head.weight", (c.vocab_size, hidden))
    return Qwen3Weights(
        embed=embed,
        layers=layers,
        final_norm=reader.get("model.norm.weight", (hidden,)),
        lm_head=lm_head,
    )

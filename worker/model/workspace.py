"""Every intermediate of a launch, allocated once: a launch of up to ``max_rows`` tokens (every
decode step) allocates nothing, which is also what lets a device graph capture it. A longer
launch (prompt chunks) allocates its own layer buffers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fusedserve.kernels.attention import AttentionBackend
from fusedserve.kernels.layer_ops import NormScratch
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.worker.model.tensor_parallel import SINGLE, TensorParallel


@dataclass
class HybridBuffers:
    """A hybrid model's extra intermediates for n rows: the attention output gate, the Gated
    DeltaNet's projection, conv output and normed output, the shared expert's."""

    gate: torch.Tensor  # [n, q]: h W_gate
    delta_proj: torch.Tensor  # [n, q + k + v + z + b + a]
    delta_conv: torch.Tensor  # [n, q + k + v]
    delta_out: torch.Tensor  # [n, value heads x dv]
    shared_gate_up: torch.Tensor  # [n, 2 W] (W = 0 without a shared expert)
    shared_act: torch.Tensor  # [n, W]
    shared_out: torch.Tensor  # [n, D]
    shared_gate: torch.Tensor  # [n, 1]

    @classmethod
    def allocate(cls, c: Qwen3Config, n: int, dtype: torch.dtype, device: torch.device) -> HybridBuffers:
        la, w = c.linear_attention, c.shared_expert_intermediate_size or 0
        kw = {"dtype": dtype, "device": device}
        return cls(torch.empty(n, c.q_size, **kw), torch.empty(n, la.in_proj_rows, **kw),
                   torch.empty(n, la.conv_dim, **kw), torch.empty(n, la.value_dim, **kw),
                   torch.empty(n, 2 * w, **kw), torch.empty(n, w, **kw), torch.empty(n, c.hidden_size, **kw),
                   torch.empty(n, 1, **kw))

    def rows(self, n: int) -> HybridBuffers:
        return HybridBuffers(*(getattr(self, f.name)[:n] for f in dataclasses.fields(self)))


@dataclass
class LayerBuffers:
    """One layer's intermediates for n rows."""

    h: torch.Tensor  # [n, D] normed input of attention / MLP
    qkv: torch.Tensor  # [n, q + 2 kv]
    q: torch.Tensor  # [n, heads, hd]: normed, rotated q
    attn: torch.Tensor  # [n, heads, hd]
    o: torch.Tensor  # [n, D]: projection outputs added to the residual
    gate_up: torch.Tensor  # [n, 2 I]
    act: torch.Tensor  # [n, I]
    norm: NormScratch
    hybrid: HybridBuffers | None = None  # a hybrid model's (Qwen3.5, Qwen3-Next)

    @classmethod
    def allocate(cls, c: Qwen3Config, n: int, dtype: torch.dtype, device: torch.device) -> LayerBuffers:
        kw = {"dtype": dtype, "device": device}
        nh, hd = c.num_attention_heads, c.head_dim
        return cls(
            h=torch.empty(n, c.hidden_size, **kw), qkv=torch.empty(n, c.q_size + 2 * c.kv_size, **kw),
            q=torch.empty(n, nh, hd, **kw), attn=torch.empty(n, nh, hd, **kw),
            o=torch.empty(n, c.hidden_size, **kw), gate_up=torch.empty(n, 2 * c.intermediate_size, **kw),
            act=torch.empty(n, c.intermediate_size, **kw),
            norm=NormScratch.allocate(n, c.hidden_size, nh, c.num_key_value_heads, hd, dtype, device),
            hybrid=HybridBuffers.allocate(c, n, dtype, device) if c.hybrid else None,
        )

    def rows(self, n: int) -> LayerBuffers:
        """Views of the first n rows (no allocation)."""
        return LayerBuffers(self.h[:n], self.qkv[:n], self.q[:n], self.attn[:n], self.o[:n], self.gate_up[:n],
                            self.act[:n], self.norm.rows(n),
                            None if self.hybrid is None else self.hybrid.rows(n))


class Workspace:
    def __init__(self, c: Qwen3Config, max_rows: int, attention: AttentionBackend, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel = SINGLE):
        kw = {"dtype": dtype, "device": device}
        self.config, self.dtype, self.device = c, dtype, device
        self.max_rows = max_rows
        self.attention = attention
        self.hidden = torch.empty(max_rows, c.hidden_size, **kw)  # the residual stream
        self.cos = torch.empty(max_rows, c.head_dim, **kw)
        self.sin = torch.empty(max_rows, c.head_dim, **kw)
        self.buffers = LayerBuffers.allocate(c, max_rows, dtype, device)
        self.last = torch.empty(max_rows, dtype=torch.int32, device=device)  # rows' last tokens
        self.one = torch.ones((), dtype=torch.int32, device=device)  # a Python 1 would be boxed
        self.final = torch.empty(max_rows, c.hidden_size, **kw)  # final-normed rows for the lm_head
        # The lm_head's output where it is not the caller's float32 logits: 16-bit logits, or this
        # tensor-parallel rank's vocab share, gathered from every rank into ``logits_gathered``.
        vocab = tp.vocab_rows(c.vocab_size)
        self.logits_local = None if dtype == torch.float32 and tp.size == 1 else \
            torch.empty(max_rows, vocab, **kw)
        self.logits_gathered = None if tp.size == 1 else torch.empty(tp.size, max_rows, vocab, **kw)

    def residual(self, n: int) -> torch.Tensor:
        return self.hidden[:n] if n <= self.max_rows else \
            torch.empty(n, self.config.hidden_size, dtype=self.dtype, device=self.device)

    def rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n <= self.max_rows:
            return self.cos[:n], self.sin[:n]
        kw = {"dtype": self.dtype, "device": self.device}
        return torch.empty(n, self.config.head_dim, **kw), torch.empty(n, self.config.head_dim, **kw)

    def layer_buffers(self, n: int) -> LayerBuffers:
        return self.buffers.rows(n) if n <= self.max_rows else \
            LayerBuffers.allocate(self.config, n, self.dtype, self.device)

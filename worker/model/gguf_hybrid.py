"""A hybrid's GGUF file (llama.cpp's ``qwen35``, ``qwen35moe``, ``qwen3next``) under Hugging Face
names and values.

llama.cpp's converter (``conversion/qwen.py``: ``Qwen3NextModel``, ``_LinearAttentionVReorderBase``)
renames the Gated DeltaNet's tensors and changes some values; reading them back undoes each step:
- zero-centred norms (every RMSNorm but the delta rule's gated one) are stored as ``1 + w``;
- ``A_log`` is stored as ``ssm_a = -exp(A_log)``; ``dt_bias`` as ``ssm_dt.bias``;
- the conv's weight ``[C, 1, K]`` is stored squeezed, ``[C, K]``;
- Qwen3.5 (not Qwen3-Next): where value heads outnumber key heads, every value-head axis (v rows of
  ``attn_qkv`` and of the conv, ``attn_gate`` rows, ``ssm_beta`` / ``ssm_alpha`` rows, ``ssm_a``,
  ``ssm_dt``, ``ssm_out`` columns) is reordered from grouped by key head to tiled: value head j of
  key head g at j * nk + g;
- Qwen3-Next: its per-key-head ``in_proj_qkvz`` is split into ``attn_qkv`` and ``attn_gate`` (Qwen3.5's
  layout, which the loader reads as such); ``in_proj_ba`` stays interleaved, as ``ssm_ba``.
The full-attention layers' ``attn_q`` keeps each head's query and output gate as Hugging Face's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Where a hybrid's names differ from or add to Qwen3's (``gguf_tensors._LAYER``), per layer.
NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight",
         "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
         "linear_attn.in_proj_z.weight": "attn_gate.weight",
         "linear_attn.in_proj_b.weight": "ssm_beta.weight",
         "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
         "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.A_log": "ssm_a",
         "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.norm.weight": "ssm_norm.weight",
         "linear_attn.out_proj.weight": "ssm_out.weight", "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
         "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
         "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
         "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
         "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight"}
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                "self_attn.k_norm.weight")


@dataclass(frozen=True)
class HybridLayout:
    key_heads: int
    value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    tiled: bool  # value heads reordered to tiled (Qwen3.5's converter; not Qwen3-Next's)

    @classmethod
    def from_metadata(cls, get: Callable[[str], object], arch: str) -> HybridLayout:
        nv = int(get(f"{arch}.ssm.time_step_rank"))
        return cls(int(get(f"{arch}.ssm.group_count")), nv, int(get(f"{arch}.ssm.state_size")),
                   int(get(f"{arch}.ssm.inner_size")) // nv, arch != "qwen3next")

    def _value_order(self, head: int) -> torch.Tensor:
        """Stored index of each Hugging Face index along a value-head axis of ``head`` elements per head."""
        nk, per = self.key_heads, self.value_heads // self.key_heads
        idx = torch.arange(self.value_heads * head).view(per, nk, head)  # stored: tiled [j, g]
        return idx.transpose(0, 1).reshape(-1)  # Hugging Face order: grouped [g, j]

    def fix(self, hf: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What turns the stored fp32 values of ``hf`` (whole, row-major) into Hugging Face's; None
        where they are the same."""
        if hf == "model.norm.weight" or any(hf.endswith(z) for z in ZERO_CENTRED):
            return lambda t: t - 1.0
        if not hf.startswith("model.layers.") or ".linear_attn." not in hf:
            return None
        part = hf.split(".linear_attn.", 1)[1]
        reorder = self.tiled and self.value_heads != self.key_heads
        qk = 2 * self.key_heads * self.key_dim
        if part == "A_log":
            return lambda t: torch.log(-t[self._value_order(1)] if reorder else -t)
        if part == "conv1d.weight":
            def conv(t: torch.Tensor) -> torch.Tensor:
                if reorder:
                    t = torch.cat([t[:qk], t[qk:][self._value_order(self.value_dim)]])
                return t.unsqueeze(1)
            return conv
        if not reorder:
            return None
        if part == "in_proj_qkv.weight":
            return lambda t: torch.cat([t[:qk], t[qk:][self._value_order(self.value_dim)]])
        if part == "in_proj_z.weight":
            return lambda t: t[self._value_order(self.value_dim)]
        if part in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias"):
            return lambda t: t[self._value_order(1)]
        if part == "out_proj.weight":
            return lambda t: t[:, self._value_order(self.value_dim)]
        return None

"""The hybrid Qwen models' part of a config (Qwen3-Next, Qwen3.5 dense and MoE): which layers are
Gated DeltaNet linear attention and which full attention, the linear layers' heads and conv, and
what changes the full-attention layers' math (an output gate, partial rotary, zero-centred norms).

Parsed strictly, as the rest of the config: a value that changes the math and is not supported is
refused with its field named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusedserve.kernels.model_description.config_error import ConfigError

# model_type -> whether its MoE router always renormalises its top-k (the loader reads the tensor
# layout, Qwen3-Next's per-key-head or Qwen3.5's, from the checkpoint's names)
HYBRID_TYPES = {"qwen3_next": False, "qwen3_5_text": False, "qwen3_5_moe_text": True}
# A Qwen3.5 ``...ForConditionalGeneration`` config: its language model's is under ``text_config``.
MULTIMODAL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet layer's shape: q/k heads of ``key_head_dim``, v heads of
    ``value_head_dim`` (each q/k head serves ``num_value_heads // num_key_heads`` of them) and the
    depthwise causal conv over q, k and v."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_rows(self) -> int:
        """The fused input projection's outputs: q, k, v, z (the output gate), b, a."""
        return self.conv_dim + self.value_dim + 2 * self.num_value_heads

    def state_elements(self) -> tuple[int, int]:
        """(conv state, recurrent state) elements of one sequence in one layer."""
        return (self.conv_dim * (self.conv_kernel - 1),
                self.num_value_heads * self.key_head_dim * self.value_head_dim)


def hybrid_fields(raw: dict[str, Any], model_type: str, layers: int, head_dim: int,
                  source: str) -> dict[str, Any]:
    """The ``Qwen3Config`` fields of a hybrid config ``raw`` (its text part)."""
    renormalise = HYBRID_TYPES[model_type]

    def need_int(key: str, default: int | None = None) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{source}: field {key!r} must be an integer >= 1, got {value!r}")
        return value

    types = raw.get("layer_types")
    if types is None:
        interval = need_int("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in ("full_attention", "linear_attention") for t in types)):
        raise ConfigError(f"{source}: field 'layer_types' must list 'full_attention' or 'linear_attention' "
                          f"for each of the {layers} layers, got {types!r}")
    if "full_attention" not in types:
        raise ConfigError(f"{source}: field 'layer_types' has no full_attention layer")
    linear = LinearAttention(need_int("linear_num_key_heads"), need_int("linear_num_value_heads"),
                             need_int("linear_key_head_dim"), need_int("linear_value_head_dim"),
                             need_int("linear_conv_kernel_dim", 4))
    if linear.num_value_heads % linear.num_key_heads:
        raise ConfigError(f"{source}: linear_num_value_heads ({linear.num_value_heads}) is not a multiple of "
                          f"linear_num_key_heads ({linear.num_key_heads})")
    if linear.conv_kernel < 2:
        raise ConfigError(f"{source}: field 'linear_conv_kernel_dim' must be >= 2, got {linear.conv_kernel}")
    rope = {**(raw.get("rope_scaling") or {}), **(raw.get("rope_parameters") or {})}
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' must be in (0, 1], got {partial!r}")
    rotary = int(head_dim * partial)
    if rotary % 2:
        raise ConfigError(f"{source}: partial_rotary_factor {partial} gives an odd rotary dim {rotary}")
    section = rope.get("mrope_section")
    if section is not None and (not isinstance(section, list) or sum(section) != rotary // 2):
        raise ConfigError(f"{source}: field 'mrope_section' must sum to the rotary pairs ({rotary // 2}), "
                          f"got {section!r}")
    if raw.get("attn_output_gate", True) is not True:
        raise ConfigError(f"{source}: field 'attn_output_gate' false is not supported")
    out: dict[str, Any] = dict(layer_types=tuple(types), linear_attention=linear, rotary_dim=rotary)
    if raw.get("num_experts"):
        out["shared_expert_intermediate_size"] = raw.get("shared_expert_intermediate_size") or 0
        if renormalise:
            out["norm_topk_prob"] = True
    return out

"""Qwen3 model configuration, read from a Hugging Face ``config.json``.

Parsing is strict on purpose: a wrong or missing field in a checkpoint should fail
at load time with the field's name, not later as a shape error deep in a layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fusedserve.kernels.model_description.config_error import ConfigError
from fusedserve.kernels.model_description.hybrid import (
    HYBRID_TYPES,
    MULTIMODAL_TYPES,
    LinearAttention,
    hybrid_fields,
)
from fusedserve.kernels.native import build as native

__all__ = ["ConfigError", "Qwen3Config", "parse_dtype", "resolve_dtype"]

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,  # vLLM's names
    "float": torch.float32,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a dtype name (``bf16``, ``bfloat16``, ...) to a torch dtype."""
    if isinstance(name, torch.dtype):
        if name not in _DTYPES.values():
            raise ConfigError(f"unsupported dtype {name}; use float32, bfloat16 or float16")
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(
            f"unsupported dtype {name!r}; use one of {sorted(set(_DTYPES))}"
        ) from None


@dataclass(frozen=True)
class Qwen3Config:
    """The fields of a Qwen3 checkpoint that the kernels use: dense (``qwen3``) or mixture of
    experts (``qwen3_moe``: ``num_experts`` > 0)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768
    # YaRN (``rope_scaling`` / ``rope_parameters`` with rope_type "yarn"): factor,
    # original_max_position_embeddings, beta_fast, beta_slow, attention_factor, mscale,
    # mscale_all_dim, truncate, as transformers reads them. None: plain rotary.
    yarn: tuple[tuple[str, Any], ...] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_ids: tuple[int, ...] = field(default=())
    bos_token_id: int | None = None
    dtype: str = "bfloat16"
    # Qwen3-MoE: a sparse layer routes each token to its num_experts_per_tok best experts (of
    # num_experts, each an MLP of moe_intermediate_size); layers in mlp_only_layers, and those
    # off the decoder_sparse_step grid, keep a dense MLP of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Hybrids (Qwen3-Next, Qwen3.5; ``hybrid.py``): each layer's kind (empty: every layer full
    # attention), the linear layers' shape, the rotary dims of a head (partial rotary), and the
    # sigmoid-gated shared expert of their MoE layers.
    layer_types: tuple[str, ...] = ()
    linear_attention: LinearAttention | None = None
    rotary_dim: int = 0
    shared_expert_intermediate_size: int = 0

    @property
    def hybrid(self) -> bool:
        """Gated DeltaNet layers beside full attention: gated attention, zero-centred norms."""
        return bool(self.layer_types)

    def linear_layer(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with a KV cache."""
        return tuple(i for i in range(self.num_hidden_layers) if not self.linear_layer(i))

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers with a recurrent state per sequence."""
        return tuple(i for i in range(self.num_hidden_layers) if self.linear_layer(i))

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One sequence's recurrent state over every linear layer: the conv state in ``dtype``, the
        delta rule's in float32."""
        if self.linear_attention is None:
            return 0
        conv, rec = self.linear_attention.state_elements()
        return len(self.linear_layers) * (conv * dtype.itemsize + rec * 4)

    @property
    def max_context(self) -> int:
        """The context the model supports: YaRN stretches its original window by its factor."""
        if self.yarn is None:
            return self.max_position_embeddings
        y = dict(self.yarn)
        original = y.get("original_max_position_embeddings") or self.max_position_embeddings
        return max(self.max_position_embeddings, int(original * y["factor"]))

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts (transformers' rule)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> Qwen3Config:
        """Validate a parsed config.json; ``source`` names the file in error messages."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type", "qwen3")
        if model_type in MULTIMODAL_TYPES:  # served as a text model: its language model's config
            text = raw.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"{source}: model_type {model_type!r} needs a 'text_config' object")
            outer = {k: raw[k] for k in ("eos_token_id", "bos_token_id", "tie_word_embeddings") if k in raw}
            raw = {**outer, **text, "model_type": MULTIMODAL_TYPES[model_type]}
            model_type = raw["model_type"]
        known = ("qwen3", "qwen3_moe", *HYBRID_TYPES, *MULTIMODAL_TYPES)
        if model_type not in known:
            raise ConfigError(f"{source}: model_type {model_type!r} is not supported (want one of "
                              f"{', '.join(known)})")

        def need_int(key: str, default: int | None = None, minimum: int = 1) -> int:
            value = raw.get(key, default)
            if value is None:
                raise ConfigError(f"{source}: missing required field {key!r}")
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{source}: field {key!r} must be an integer, got {value!r}")
            if value < minimum:
                raise ConfigError(f"{source}: field {key!r} must be >= {minimum}, got {value}")
            return value

        def need_float(key: str, default: float) -> float:
            value = raw.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{source}: field {key!r} must be a number, got {value!r}")
            return float(value)

        hidden = need_int("hidden_size")
        heads = need_int("num_attention_heads")
        kv_heads = need_int("num_key_value_heads", heads)
        head_dim = need_int("head_dim", hidden // heads if hidden % heads == 0 else None)
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads ({heads}) is not a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        if head_dim % 2:
            raise ConfigError(f"{source}: head_dim must be even for rotary embedding, got {head_dim}")

        rope = raw.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"{source}: field 'rope_parameters' must be an object")
        scaling = raw.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise ConfigError(f"{source}: field 'rope_scaling' must be an object")
        params = {**scaling, **rope}
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ConfigError(f"{source}: rope type {rope_type!r} is not supported ('default' or 'yarn')")
        yarn = None
        if rope_type == "yarn":
            factor = params.get("factor")
            if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor < 1:
                raise ConfigError(f"{source}: YaRN needs a rope 'factor' >= 1, got {factor!r}")
            keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                    "attention_factor", "mscale", "mscale_all_dim", "truncate")
            yarn = tuple((k, params[k]) for k in keys if params.get(k) is not None)
        theta = rope.get("rope_theta", raw.get("rope_theta", 1_000_000.0))
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
            raise ConfigError(f"{source}: rope_theta must be a positive number, got {theta!r}")

        if raw.get("use_sliding_window"):
            raise ConfigError(f"{source}: sliding-window attention is not supported")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act {act!r} is not supported (want 'silu')")

        eos = raw.get("eos_token_id")
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, int) and not isinstance(eos, bool):
            eos_ids = (eos,)
        elif isinstance(eos, list) and all(isinstance(e, int) for e in eos):
            eos_ids = tuple(eos)
        else:
            raise ConfigError(f"{source}: eos_token_id must be an int or list of ints, got {eos!r}")

        dtype = raw.get("dtype", raw.get("torch_dtype")) or "bfloat16"
        parse_dtype(dtype)
        moe = {}
        if model_type == "qwen3_moe" or (model_type in HYBRID_TYPES and raw.get("num_experts")):
            layers = need_int("num_hidden_layers")
            only = raw.get("mlp_only_layers") or []
            if not isinstance(only, list) or not all(isinstance(i, int) and 0 <= i < layers for i in only):
                raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, got {only!r}")
            experts = need_int("num_experts", raw.get("num_local_experts"))
            moe = dict(num_experts=experts, moe_intermediate_size=need_int("moe_intermediate_size"),
                       num_experts_per_tok=need_int("num_experts_per_tok"),
                       norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
                       decoder_sparse_step=need_int("decoder_sparse_step", 1), mlp_only_layers=tuple(only))
            if moe["num_experts_per_tok"] > experts:
                raise ConfigError(f"{source}: num_experts_per_tok ({moe['num_experts_per_tok']}) exceeds "
                                  f"num_experts ({experts})")
        if model_type in HYBRID_TYPES:
            moe.update(hybrid_fields(raw, model_type, need_int("num_hidden_layers"), head_dim, source))
        return cls(
            vocab_size=need_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need_int("intermediate_size", moe.get("moe_intermediate_size")),
            num_hidden_layers=need_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=need_float("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            max_position_embeddings=need_int("max_position_embeddings", 32768),
            yarn=yarn,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            dtype=dtype,
            **moe,
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Qwen3Config:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no config.json in model directory")
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{path}: malformed config.json: {exc}") from None
        return cls.from_dict(raw, source=str(path))


def resolve_dtype(dtype: str | torch.dtype | None, checkpoint: torch.dtype, device_type: str) -> torch.dtype:
    """None: the checkpoint's dtype. ``"auto"``: the fastest here for this checkpoint.

    On an accelerator, the checkpoint's 16-bit dtype (bf16 for an fp32 checkpoint). On the
    CPU with the native kernels, the same (they stream 16-bit weights, half fp32's bytes);
    without them, bf16 where the CPU has AVX-512 BF16 (oneDNN's bf16 matmul), else fp32
    (ATen's bf16 matmul is several times slower than its fp32 one there).
    """
    if dtype is None:
        return checkpoint
    if dtype != "auto":
        return parse_dtype(dtype)
    sixteen = checkpoint if checkpoint in (torch.bfloat16, torch.float16) else torch.bfloat16
    if device_type != "cpu" or native.expected():
        return sixteen
    return torch.bfloat16 if "avx512_bf16" in native.cpu_flags() else torch.float32

"""A PEFT LoRA adapter as fusedserve serves it: its rank, scaling and the projections it changes.

Read from ``adapter_config.json`` and the tensor names of ``adapter_model.safetensors`` (the names
are what an adapter really changes: ``target_modules`` may be a regex, and ``layers_to_transform``
leaves some layers out). What the fused step cannot apply is refused here, before any worker
loads it, with the field or module named: a LoRA on the embeddings or the head, DoRA, biases, extra
trained modules, per-module ranks, or a rank above ``--max-lora-rank``.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from fusedserve.kernels.model_description.config_error import ConfigError

# The projections a LoRA may change, by PEFT's (transformers') module name.
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION + MLP
CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT's save of a causal LM).
TENSOR = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\."
                    r"(\w+)\.lora_([AB])(?:\.default)?\.weight$")


class LoraError(ConfigError):
    """An adapter that cannot be served (its reason names the field or module)."""


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter: ``modules`` is every (layer, projection) it changes, each with an A of
    ``rank`` rows and a B of ``rank`` columns; its update is ``scaling * B @ A``."""

    name: str
    path: str
    rank: int
    alpha: float
    rslora: bool
    modules: frozenset[tuple[int, str]]
    base_model: str | None = None

    @property
    def scaling(self) -> float:
        """PEFT's: alpha / r, or alpha / sqrt(r) for rank-stabilised LoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    @property
    def targets(self) -> tuple[str, ...]:
        """The projections it changes in some layer, in ``TARGETS`` order."""
        names = {name for _, name in self.modules}
        return tuple(t for t in TARGETS if t in names)

    @classmethod
    def from_dir(cls, name: str, path: str | Path, max_rank: int,
                 num_layers: int | None = None) -> LoraAdapter:
        """The adapter in PEFT directory ``path``, or ``LoraError`` naming what cannot be served."""
        d = Path(path)
        try:
            cfg = json.loads((d / CONFIG).read_text())
        except (OSError, ValueError) as exc:
            raise LoraError(f"adapter {name!r}: no readable {CONFIG} in {d} ({exc})") from None
        _check_config(name, cfg)
        rank = cfg.get("r")
        if not isinstance(rank, int) or rank < 1:
            raise LoraError(f"adapter {name!r}: r must be a positive integer, got {rank!r}")
        if rank > max_rank:
            raise LoraError(f"adapter {name!r} has rank {rank}; this server allows {max_rank} "
                            "(--max-lora-rank)")
        alpha = cfg.get("lora_alpha", rank)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
            raise LoraError(f"adapter {name!r}: lora_alpha must be a positive number, got {alpha!r}")
        modules = _modules(name, d / WEIGHTS, rank, num_layers)
        return cls(name, str(d), rank, float(alpha), bool(cfg.get("use_rslora", False)), modules,
                   cfg.get("base_model_name_or_path"))


def _check_config(name: str, cfg: dict) -> None:
    """Refuse what the config asks that the fused step does not apply, by field."""
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"adapter {name!r} is a {peft_type} adapter; only LoRA is served")
    refusals = {"use_dora": "DoRA (use_dora)",
                "modules_to_save": "fully trained extra modules (modules_to_save)",
                "rank_pattern": "per-module ranks (rank_pattern)",
                "alpha_pattern": "per-module alphas (alpha_pattern)",
                "fan_in_fan_out": "fan_in_fan_out weights (a GPT-2 Conv1D layout)"}
    for key, what in refusals.items():
        if cfg.get(key):
            raise LoraError(f"adapter {name!r} uses {what}, which is not served")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise LoraError(f"adapter {name!r} trains biases (bias={bias!r}); only bias='none' is served")


def _modules(name: str, weights: Path, rank: int, num_layers: int | None) -> frozenset[tuple[int, str]]:
    """Every (layer, projection) with both an A and a B of the adapter's rank."""
    if not weights.is_file():
        raise LoraError(f"adapter {name!r}: no {WEIGHTS} in {weights.parent}")
    seen: dict[tuple[int, str], set[str]] = {}
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():
            m = TENSOR.match(key)
            if m is None:
                raise LoraError(f"adapter {name!r} changes {key!r}; only the projections "
                                f"{', '.join(TARGETS)} of the decoder layers are served")
            layer, module, side = int(m.group(1)), m.group(2), m.group(3)
            if module not in TARGETS:
                raise LoraError(f"adapter {name!r} targets {module!r}; served targets are "
                                f"{', '.join(TARGETS)}")
            if num_layers is not None and layer >= num_layers:
                raise LoraError(f"adapter {name!r} changes layer {layer}; the model has {num_layers}")
            shape = f.get_slice(key).get_shape()
            if len(shape) != 2 or shape[0 if side == "A" else 1] != rank:
                raise LoraError(f"adapter {name!r}: {key} has shape {shape}, not rank {rank}")
            seen.setdefault((layer, module), set()).add(side)
    half = [f"layer {layer} {module}" for (layer, module), sides in seen.items() if sides != {"A", "B"}]
    if half:
        raise LoraError(f"adapter {name!r}: {half[0]} has only one of lora_A and lora_B")
    if not seen:
        raise LoraError(f"adapter {name!r}: {WEIGHTS} holds no LoRA weights")
    return frozenset(seen)


def check_fits(adapter: LoraAdapter, c) -> None:
    """Refuse ``adapter`` for a model of config ``c`` (a ``Qwen3Config``) unless every A and B has the
    shape of the projection it changes: a LoRA trained on another base is refused at load, by
    tensor, instead of failing inside a launch."""
    if c.hybrid or c.num_experts:
        raise LoraError(f"adapter {adapter.name!r}: LoRA is served on dense Qwen3 models; this one is "
                        f"{'a hybrid' if c.hybrid else 'a mixture of experts'}")
    h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
            "up_proj": (h, i), "down_proj": (i, h)}  # (in, out)
    with safe_open(adapter.path + "/" + WEIGHTS, framework="pt") as f:
        for key in f.keys():
            m = TENSOR.match(key)
            layer, module, side = int(m.group(1)), m.group(2), m.group(3)
            if layer >= c.num_hidden_layers:
                raise LoraError(f"adapter {adapter.name!r} changes layer {layer}; the model has "
                                f"{c.num_hidden_layers}")
            fan_in, fan_out = dims[module]
            want = [adapter.rank, fan_in] if side == "A" else [fan_out, adapter.rank]
            shape = list(f.get_slice(key).get_shape())
            if shape != want:
                raise LoraError(f"adapter {adapter.name!r}: {key} has shape {shape}; this model's "
                                f"{module} needs {want} (an adapter of another base model?)")


def slot_bytes(c, rank: int, itemsize: int) -> int:
    """One adapter slot of a model of config ``c`` at ``rank`` (a worker holds ``--max-loras`` of
    them; the KV budget leaves them out): every layer's A and B of its seven projections."""
    h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    per_layer = rank * (3 * h + (q + 2 * kv) + q + h + 2 * h + 2 * i + i + h)
    return per_layer * c.num_hidden_layers * itemsize

"""The loaded weights of a model, as records, and their preparation for the kernels: moved to
the device, quantized at load where asked, each projection packed into its kernel's layout."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fusedserve.kernels.linear import Int4Weight, Int8Weight, LinearOp, Weight


@dataclass
class LinearAttnWeights:
    """A Gated DeltaNet layer (Qwen3-Next, Qwen3.5), in one layout whatever the checkpoint's."""

    in_proj: Weight  # [q, k, v, z (value dim each for v and z), b, a (a row per value head)] x hidden
    conv: torch.Tensor  # [q + k + v channels, kernel]: the depthwise causal conv
    dt_bias: torch.Tensor  # [value heads] float32
    neg_a: torch.Tensor  # [value heads] float32: -exp(A_log), each head's decay rate
    norm: torch.Tensor  # [value_head_dim]: the gated RMSNorm of the output
    out_proj: Weight  # [hidden, value dim]


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # Full attention (None in a linear-attention layer): q/k/v fused; a hybrid's q and k rows are
    # permuted so that its partial rotary pairs sit where rotate-half rotates (layer_ops.py).
    qkv: torch.Tensor | None  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]
    o_proj: torch.Tensor | None  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor | None  # [2 * intermediate, hidden]; None in a sparse (MoE) layer
    down: torch.Tensor | None  # [hidden, intermediate]
    router: torch.Tensor | None = None  # [experts, hidden]: a sparse layer's gate
    # A sparse layer's experts: each its (gate_up [2 * moe_intermediate, hidden], down); None for
    # an expert another rank holds (expert parallelism).
    experts: list[tuple[torch.Tensor, torch.Tensor] | None] | None = None
    # The same experts stacked, (gate_up [E, 2 * moe_intermediate, hidden], down [E, hidden, mi]),
    # where the grouped-GEMM path runs them (``experts`` are then views into these).
    expert_stack: tuple[torch.Tensor, torch.Tensor] | None = None
    linear_attn: LinearAttnWeights | None = None  # a hybrid's linear-attention layer
    attn_gate: Weight | None = None  # [q_size, hidden]: a hybrid's attention output gate
    # A hybrid MoE layer's shared expert: its MLP and the sigmoid gate [1, hidden] of its output.
    shared_gate_up: Weight | None = None
    shared_down: Weight | None = None
    shared_gate: torch.Tensor | None = None


@dataclass
class Qwen3Weights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    # [vocab, hidden]; the embedding itself when tied; None in an embedding checkpoint that has none
    # (a pooling runner reads the final hidden state, never the logits).
    lm_head: torch.Tensor | None
    # A sequence-classification checkpoint's head, ``score.weight`` [labels, hidden] (a pooling
    # runner's score task), kept as read: it multiplies one row per request.
    classifier: torch.Tensor | None = None


# The projections a layer may have, each quantized and packed like the others.
PROJECTIONS = ("qkv", "o_proj", "gate_up", "down", "attn_gate", "shared_gate_up", "shared_down")


@dataclass(frozen=True)
class Quantizer:
    """A projection quantized as ``mode`` asks (int4: groups of 32; else int8 per channel); one
    quantized already (as it was read) is kept."""

    mode: str
    dtype: torch.dtype
    device: torch.device

    def __call__(self, weight: Weight) -> Weight:
        if not isinstance(weight, torch.Tensor):
            return weight
        if self.mode == "int4":
            return Int4Weight.quantize(weight, self.device)
        return Int8Weight.quantize(weight, self.dtype, self.device)


def prepare_weights(w: Qwen3Weights, linear: LinearOp, quantization: str | None, dtype: torch.dtype,
                    device: torch.device, grouped_moe: bool) -> Qwen3Weights:
    """The loaded weights as the kernels run them: on ``device``, quantized at load where asked
    (``int8``, ``int8-weight-only``, ``int4``), then each projection packed into its kernel's
    layout (and a MoE layer's experts stacked where ``grouped_moe``)."""
    w = _to_device(w, device)
    if quantization:
        _quantize(w, quantization, dtype, device)
    _prepare(w, linear, grouped_moe)
    return w


def _quantize(w: Qwen3Weights, mode: str, dtype: torch.dtype, device: torch.device) -> None:
    """Every projection (and the lm_head) quantized in place, one tensor at a time (peak memory
    stays near the 16-bit model's). int8: per channel, everything. int4: groups of 32 for the
    projections, the lm_head int8 (the logits keep 8 bits, as llama.cpp keeps 6 there). The
    embedding gather stays 16-bit."""
    q = Quantizer(mode, dtype, device)
    for lw in w.layers:
        for name in PROJECTIONS:
            if getattr(lw, name) is not None:
                setattr(lw, name, q(getattr(lw, name)))
        if lw.linear_attn is not None:
            lw.linear_attn.in_proj, lw.linear_attn.out_proj = (q(lw.linear_attn.in_proj),
                                                                q(lw.linear_attn.out_proj))
        if lw.experts is not None:  # the experts; the router stays 16-bit (routing is sensitive)
            lw.experts = [None if ex is None else (q(ex[0]), q(ex[1])) for ex in lw.experts]
    if w.lm_head is not None:
        w.lm_head = Int8Weight.quantize(w.lm_head, dtype, device)


def _prepare(w: Qwen3Weights, linear: LinearOp, grouped_moe: bool) -> None:
    """Every projection and the lm_head in its kernel's layout, in place (the embedding gather
    keeps its own tensor, so a tied lm_head is then a packed copy). ``grouped_moe``: a sparse
    layer's 16-bit experts, all held here, stacked for the grouped GEMMs."""
    for lw in w.layers:
        for name in (*PROJECTIONS, "router"):
            if getattr(lw, name) is not None:
                setattr(lw, name, linear.prepare(getattr(lw, name)))
        if lw.linear_attn is not None:
            la = lw.linear_attn
            la.in_proj, la.out_proj = linear.prepare(la.in_proj), linear.prepare(la.out_proj)
        if (grouped_moe and lw.experts is not None and all(isinstance(ex, tuple) for ex in lw.experts)
                and all(isinstance(t, torch.Tensor) for ex in lw.experts for t in ex)):
            lw.expert_stack = (torch.stack([gu for gu, _ in lw.experts]),
                               torch.stack([d for _, d in lw.experts]))
            lw.experts = [(lw.expert_stack[0][e], lw.expert_stack[1][e]) for e in range(len(lw.experts))]
        elif lw.experts is not None:
            lw.experts = [None if ex is None else (linear.prepare(ex[0]), linear.prepare(ex[1]))
                          for ex in lw.experts]
    if w.lm_head is not None:
        w.lm_head = linear.prepare_head(w.lm_head)


def _to_device(w: Qwen3Weights, device: torch.device) -> Qwen3Weights:
    if device.type == "cpu":
        return w
    embed = w.embed.to(device)

    def move(t):
        if isinstance(t, list):  # a sparse layer's experts
            return [None if ex is None else (ex[0].to(device), ex[1].to(device)) for ex in t]
        if isinstance(t, LinearAttnWeights):
            return LinearAttnWeights(**{k: v.to(device) for k, v in vars(t).items()})
        return None if t is None else t.to(device)

    return Qwen3Weights(
        embed=embed,
        layers=[type(lw)(**{k: move(t) for k, t in vars(lw).items()}) for lw in w.layers],
        final_norm=w.final_norm.to(device),
        lm_head=embed if w.lm_head is w.embed else move(w.lm_head),
        classifier=move(w.classifier),
    )

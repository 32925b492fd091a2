"""The hybrid models' tensors (Qwen3-Next, Qwen3.5 dense and MoE), read into the records of
``weights.py`` in one layout whatever the checkpoint's.

- A linear-attention layer's input projections fuse into one matrix, rows [q, k, v, z, b, a]
  (Qwen3-Next stores q/k/v/z and b/a interleaved per key head: they are regrouped here).
- A full-attention layer's q_proj holds each head's query and then its output gate: they are
  split, and q and k rows permuted for partial rotary (``layer_ops.rotary_permutation``).
- Every RMSNorm but the gated one is zero-centred (``x * (1 + w)``): ``1 + w`` is stored.
"""

from __future__ import annotations

import torch

from fusedserve.kernels.layer_ops import rotary_permutation
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.worker.model.weights import LinearAttnWeights


def norm(reader, name: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-centred RMSNorm's weight as ``hybrid_norms.py`` multiplies by it: ``1 + w``, float32
    (transformers widens the stored weight and adds 1 in float32)."""
    return 1.0 + reader.get(name, (dim,)).float()


def gated_attention(reader, a: str, c: Qwen3Config, pd) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q rows, output-gate rows, k rows) of a hybrid's full-attention layer, q and k permuted."""
    nh, hd, hidden = c.num_attention_heads, c.head_dim, c.hidden_size
    perm = rotary_permutation(hd, c.rotary_dim)
    both = reader.get(a + "q_proj.weight", (2 * nh * hd, hidden), dtype=pd).view(nh, 2 * hd, hidden)
    q = both[:, :hd][:, perm].reshape(nh * hd, hidden)
    gate = both[:, hd:].reshape(nh * hd, hidden).contiguous()
    k = reader.get(a + "k_proj.weight", (c.kv_size, hidden), dtype=pd).view(-1, hd, hidden)[:, perm]
    return q, gate, k.reshape(c.kv_size, hidden)


def qk_norms(reader, a: str, c: Qwen3Config, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    perm = rotary_permutation(c.head_dim, c.rotary_dim)
    return (norm(reader, a + "q_norm.weight", c.head_dim, dtype)[perm].contiguous(),
            norm(reader, a + "k_norm.weight", c.head_dim, dtype)[perm].contiguous())


def linear_attention(reader, p: str, c: Qwen3Config, dtype: torch.dtype, pd, quantize) -> LinearAttnWeights:
    """Layer ``p``'s Gated DeltaNet (``p``: its ``linear_attn.`` prefix)."""
    la, hidden = c.linear_attention, c.hidden_size
    nk, nv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
    if c.checkpoint_layout == "qwen3_next":  # per key head: [q, k, v, z] and [b, a]
        r = nv // nk
        qkvz = reader.get(p + "in_proj_qkvz.weight", (2 * la.key_dim + 2 * la.value_dim, hidden), dtype=pd)
        qkvz = qkvz.view(nk, 2 * dk + 2 * r * dv, hidden)
        ba = reader.get(p + "in_proj_ba.weight", (2 * nv, hidden), dtype=pd).view(nk, 2 * r, hidden)
        cuts = [0, dk, 2 * dk, 2 * dk + r * dv, 2 * dk + 2 * r * dv]
        parts = [qkvz[:, cuts[i]:cuts[i + 1]].reshape(-1, hidden) for i in range(4)]
        parts += [ba[:, :r].reshape(nv, hidden), ba[:, r:].reshape(nv, hidden)]
    else:
        parts = [reader.get(p + "in_proj_qkv.weight", (la.conv_dim, hidden), dtype=pd),
                 reader.get(p + "in_proj_z.weight", (la.value_dim, hidden), dtype=pd),
                 reader.get(p + "in_proj_b.weight", (nv, hidden), dtype=pd),
                 reader.get(p + "in_proj_a.weight", (nv, hidden), dtype=pd)]
    a_log = reader.get(p + "A_log", (nv,), dtype=torch.float32)
    return LinearAttnWeights(
        in_proj=quantize(torch.cat(parts).contiguous()),
        conv=reader.get(p + "conv1d.weight", (la.conv_dim, 1, la.conv_kernel)).view(la.conv_dim,
                                                                                    la.conv_kernel),
        # transformers adds the bias in float32 to a float32 copy of a: the same as the stored value widened
        dt_bias=reader.get(p + "dt_bias", (nv,)).float(),
        neg_a=-a_log.exp(),
        norm=reader.get(p + "norm.weight", (dv,)),
        out_proj=quantize(reader.get(p + "out_proj.weight", (hidden, la.value_dim), dtype=pd)),
    )


def shared_expert(reader, p: str, c: Qwen3Config, pd, quantize) -> dict:
    """A hybrid MoE layer's shared expert and its gate, as ``LayerWeights`` fields."""
    width, hidden = c.shared_expert_intermediate_size, c.hidden_size
    if not width:
        return {}
    s = p + "mlp.shared_expert."
    gate = reader.get(s + "gate_proj.weight", (width, hidden), dtype=pd)
    up = reader.get(s + "up_proj.weight", (width, hidden), dtype=pd)
    return dict(shared_gate_up=quantize(torch.cat([gate, up]).contiguous()),
                shared_down=quantize(reader.get(s + "down_proj.weight", (hidden, width), dtype=pd)),
                shared_gate=reader.get(p + "mlp.shared_expert_gate.weight", (1, hidden)))

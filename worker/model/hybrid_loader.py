"""The hybrid models' tensors (Qwen3-Next, Qwen3.5 dense and MoE), read into the records of
``weights.py`` in one layout whatever the checkpoint's.

- A linear-attention layer's input projections fuse into one matrix, rows [q, k, v, z, b, a]
  (Qwen3-Next stores q/k/v/z and b/a interleaved per key head: they are regrouped here; which
  layout a checkpoint holds is read from its tensor names).
- A full-attention layer's q_proj holds each head's query and then its output gate: they are
  split, and q and k rows permuted for partial rotary (``layer_ops.rotary_permutation``).
- Every RMSNorm but the gated one is zero-centred (``x * (1 + w)``): ``1 + w`` is stored.
- Projections of an AWQ/GPTQ checkpoint are read packed and dequantized (``dense``): the layout
  above regroups and splits their rows; the model's quantization then quantizes the fused matrix.
"""

from __future__ import annotations

import torch

from fusedserve.kernels.layer_ops import rotary_permutation
from fusedserve.kernels.linear import Int4Weight
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.kernels.quantize import dequantize_int4
from fusedserve.worker.model.tensor_parallel import TensorParallel
from fusedserve.worker.model.weights import LinearAttnWeights


def dense(reader, name: str, shape: tuple[int, int], pd, rows: range | None = None,
          cols: range | None = None) -> torch.Tensor:
    """A projection's ``rows`` x ``cols`` as a dense matrix, whatever the checkpoint stores (an
    AWQ/GPTQ one's packed words dequantized; a 16-bit or FP8 one's values)."""
    w = reader.get(name, shape, rows=rows, cols=cols, dtype=pd, packed=True)
    return dequantize_int4(w.u, w.d, w.in_features, torch.float32, w.z) if isinstance(w, Int4Weight) else w


def _has(reader, name: str) -> bool:
    """Whether the checkpoint holds projection ``name`` (as a tensor, or packed AWQ/GPTQ words)."""
    return reader.has(name) or reader.has(name.removesuffix(".weight") + ".qweight")


def norm(reader, name: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-centred RMSNorm's weight as ``hybrid_norms.py`` multiplies by it: ``1 + w``, float32
    (transformers widens the stored weight and adds 1 in float32)."""
    return 1.0 + reader.get(name, (dim,)).float()


def gated_attention(reader, a: str, c: Qwen3Config, pd, tp: TensorParallel
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q rows, output-gate rows, k rows, v rows, o_proj) of a hybrid's full-attention layer: this
    rank's heads, q and k permuted."""
    nh, hd, hidden = c.num_attention_heads, c.head_dim, c.hidden_size
    heads, kv = tp.heads(c), tp.kv_heads(c)
    perm = rotary_permutation(hd, c.rotary_dim)
    both = dense(reader, a + "q_proj.weight", (2 * nh * hd, hidden), pd,
                 rows=range(heads.start * 2 * hd, heads.stop * 2 * hd))
    both = both.view(len(heads), 2 * hd, hidden)
    q = both[:, :hd][:, perm].reshape(-1, hidden)
    gate = both[:, hd:].reshape(-1, hidden).contiguous()
    kv_rows = range(kv.start * hd, kv.stop * hd)
    k = dense(reader, a + "k_proj.weight", (c.kv_size, hidden), pd, rows=kv_rows).view(-1, hd, hidden)
    v = dense(reader, a + "v_proj.weight", (c.kv_size, hidden), pd, rows=kv_rows)
    o = dense(reader, a + "o_proj.weight", (hidden, c.q_size), pd,
              cols=range(heads.start * hd, heads.stop * hd))
    return q, gate, k[:, perm].reshape(-1, hidden), v, o


def qk_norms(reader, a: str, c: Qwen3Config, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    perm = rotary_permutation(c.head_dim, c.rotary_dim)
    return (norm(reader, a + "q_norm.weight", c.head_dim, dtype)[perm].contiguous(),
            norm(reader, a + "k_norm.weight", c.head_dim, dtype)[perm].contiguous())


def linear_attention(reader, p: str, c: Qwen3Config, pd, quantize, tp: TensorParallel) -> LinearAttnWeights:
    """Layer ``p``'s Gated DeltaNet (``p``: its ``linear_attn.`` prefix): this rank's key heads and
    the value heads they serve."""
    la, hidden = c.linear_attention, c.hidden_size
    nk, nv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
    kh, vh = tp.split(nk), tp.split(nv)
    q_rows, v_rows = range(kh.start * dk, kh.stop * dk), range(vh.start * dv, vh.stop * dv)
    r, kd = nv // nk, la.key_dim
    if _has(reader, p + "in_proj_qkvz.weight"):  # Qwen3-Next: per key head [q, k, v, z]
        width = 2 * dk + 2 * r * dv
        qkvz = dense(reader, p + "in_proj_qkvz.weight", (nk * width, hidden), pd,
                     rows=range(kh.start * width, kh.stop * width)).view(len(kh), width, hidden)
        cuts = [0, dk, 2 * dk, 2 * dk + r * dv, width]
        parts = [qkvz[:, cuts[i] : cuts[i + 1]].reshape(-1, hidden) for i in range(4)]
    else:  # Qwen3.5 (and a Qwen3-Next GGUF file, which the converter split so): [q, k, v] and z
        name, shape = p + "in_proj_qkv.weight", (la.conv_dim, hidden)
        parts = [dense(reader, name, shape, pd, rows=q_rows),
                 dense(reader, name, shape, pd, rows=range(kd + q_rows.start, kd + q_rows.stop)),
                 dense(reader, name, shape, pd, rows=range(2 * kd + v_rows.start, 2 * kd + v_rows.stop)),
                 dense(reader, p + "in_proj_z.weight", (la.value_dim, hidden), pd, rows=v_rows)]
    if _has(reader, p + "in_proj_ba.weight"):  # Qwen3-Next: per key head [b, a]
        ba = dense(reader, p + "in_proj_ba.weight", (2 * nv, hidden), pd,
                   rows=range(kh.start * 2 * r, kh.stop * 2 * r)).view(len(kh), 2 * r, hidden)
        parts += [ba[:, :r].reshape(-1, hidden), ba[:, r:].reshape(-1, hidden)]
    else:
        parts += [dense(reader, p + "in_proj_b.weight", (nv, hidden), pd, rows=vh),
                  dense(reader, p + "in_proj_a.weight", (nv, hidden), pd, rows=vh)]
    conv = reader.get(p + "conv1d.weight", (la.conv_dim, 1, la.conv_kernel)).view(la.conv_dim, la.conv_kernel)
    channels = [*q_rows, *range(kd + q_rows.start, kd + q_rows.stop),
                *range(2 * kd + v_rows.start, 2 * kd + v_rows.stop)]
    a_log = reader.get(p + "A_log", (nv,), rows=vh, dtype=torch.float32)
    return LinearAttnWeights(
        in_proj=quantize(torch.cat(parts).contiguous()),
        conv=conv[channels].contiguous(),
        # transformers adds the bias in float32 to a float32 copy of a: the stored value widened
        dt_bias=reader.get(p + "dt_bias", (nv,), rows=vh).float(),
        neg_a=-a_log.exp(),
        norm=reader.get(p + "norm.weight", (dv,)),
        out_proj=quantize(dense(reader, p + "out_proj.weight", (hidden, la.value_dim), pd, cols=v_rows)),
    )


def shared_expert(reader, p: str, c: Qwen3Config, pd, quantize, tp: TensorParallel) -> dict:
    """A hybrid MoE layer's shared expert (this rank's slice of its width) and its gate, as
    ``LayerWeights`` fields."""
    width, hidden = c.shared_expert_intermediate_size, c.hidden_size
    if not width:
        return {}
    s, share = p + "mlp.shared_expert.", tp.split(width)
    gate = dense(reader, s + "gate_proj.weight", (width, hidden), pd, rows=share)
    up = dense(reader, s + "up_proj.weight", (width, hidden), pd, rows=share)
    return dict(shared_gate_up=quantize(torch.cat([gate, up]).contiguous()),
                shared_down=quantize(dense(reader, s + "down_proj.weight", (hidden, width), pd, cols=share)),
                shared_gate=reader.get(p + "mlp.shared_expert_gate.weight", (1, hidden)))

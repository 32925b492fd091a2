"""A Gated DeltaNet layer over a launch's rows (Qwen3-Next, Qwen3.5 linear attention).

The launch's decode rows (one token each, first) run the recurrent form batched, their states
gathered from and scattered back to their slots; each prompt chunk runs the chunked form from its
slot's state. A sequence's slot (``ForwardBatch.state_slots``) was zeroed before the launch that
carries its first chunk. Nothing is read back to the host: the prompt rows' extents are the
launch's host lists.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fusedserve.kernels import gated_delta
from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.kernels.hybrid_cache import LayerState
from fusedserve.kernels.linear import LinearOp
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.worker.model.weights import LinearAttnWeights


def delta_net_forward(c: Qwen3Config, linear: LinearOp, w: LinearAttnWeights, h: torch.Tensor,
                      batch: ForwardBatch, state: LayerState, out: torch.Tensor) -> None:
    """``out`` [n, D] = the layer's output for the normed input ``h`` [n, D]; each row's state
    advanced past its tokens."""
    la = c.linear_attention
    n, dtype = h.shape[0], h.dtype
    proj = torch.empty(n, la.in_proj_rows, dtype=dtype, device=h.device)
    linear(h, w.in_proj, proj)
    cd, vd, nv = la.conv_dim, la.value_dim, la.num_value_heads
    mixed, z = proj[:, :cd], proj[:, cd : cd + vd]
    b, a = proj[:, cd + vd : cd + vd + nv], proj[:, cd + vd + nv :]
    conv = torch.empty(n, cd, dtype=dtype, device=h.device)
    nd, slots = batch.num_decode, batch.state_slots
    if nd:
        rows = slots[:nd]
        y, new = gated_delta.conv_decode(mixed[:nd], state.conv.index_select(0, rows), w.conv)
        conv[:nd] = y
        state.conv.index_copy_(0, rows, new)
    spans = _prompt_spans(batch)
    for r, start, length in spans:
        one = state.conv[slots[r : r + 1]][0]  # a copy: written back below
        conv[start : start + length] = gated_delta.conv_prompt(mixed[start : start + length], one, w.conv)
        state.conv.index_copy_(0, slots[r : r + 1], one.unsqueeze(0))
    q, k, v = conv[:, : la.key_dim], conv[:, la.key_dim : 2 * la.key_dim], conv[:, 2 * la.key_dim :]
    q, k = gated_delta.prepare_qk(q.reshape(n, la.num_key_heads, -1), k.reshape(n, la.num_key_heads, -1), nv)
    v = v.reshape(n, nv, la.value_head_dim).float()
    beta = torch.sigmoid(b).float()
    g = w.neg_a * F.softplus(a.float() + w.dt_bias)
    core = torch.empty(n, nv, la.value_head_dim, dtype=torch.float32, device=h.device)
    if nd:
        rows = slots[:nd]
        core[:nd], new = gated_delta.recurrent(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd],
                                               state.recurrent.index_select(0, rows))
        state.recurrent.index_copy_(0, rows, new)
    for r, start, length in spans:
        e = start + length
        core[start:e], new = gated_delta.chunked(q[start:e], k[start:e], v[start:e], g[start:e],
                                                 beta[start:e], state.recurrent[slots[r : r + 1]][0])
        state.recurrent.index_copy_(0, slots[r : r + 1], new.unsqueeze(0))
    normed = gated_delta.gated_norm(core, z.reshape(n, nv, -1), w.norm, c.rms_norm_eps, dtype)
    linear(normed.reshape(n, vd), w.out_proj, out)


def _prompt_spans(batch: ForwardBatch) -> list[tuple[int, int, int]]:
    """(row, first token, tokens) of each prompt chunk, from the launch's host lists."""
    spans, start = [], batch.num_decode
    for i, length in enumerate(batch.prompt_query_lens):
        spans.append((batch.num_decode + i, start, length))
        start += length
    return spans

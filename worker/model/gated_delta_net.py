"""A Gated DeltaNet layer over a launch's rows (Qwen3-Next, Qwen3.5 linear attention).

The launch's decode rows (one token each, first) run the recurrent form batched, each row's
states updated in its slot (``DeltaNetOps``: natively in place, or gathered and scattered in torch);
each prompt chunk runs the chunked form from its slot's state (natively in place too). A sequence's slot
(``ForwardBatch.state_slots``) was zeroed before the launch that carries its first chunk. Nothing
is read back to the host: the prompt rows' extents are the launch's host lists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusedserve.kernels import gated_delta
from fusedserve.kernels.forward_batch import ForwardBatch
from fusedserve.kernels.hybrid_cache import LayerState
from fusedserve.kernels.linear import LinearOp
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.worker.model.weights import LinearAttnWeights
from fusedserve.worker.model.workspace import HybridBuffers


def delta_net_forward(c: Qwen3Config, linear: LinearOp, w: LinearAttnWeights, h: torch.Tensor,
                      batch: ForwardBatch, state: LayerState, out: torch.Tensor,
                      kv_window: Callable[[int, int], LayerState], ops: DeltaNetOps,
                      buffers: HybridBuffers) -> None:
    """``out`` [n, D] = the layer's output for the normed input ``h`` [n, D]; each row's state
    advanced past its tokens. A speculating request's rows run in order from its slot's state,
    each position's state going to ``kv_window(groups, rows)`` (the slot is left as it was: the
    runner keeps the accepted position's after verification). ``ops``: the kernels; ``buffers``: the
    workspace's intermediates for n rows (a decode step allocates nothing)."""
    la = c.linear_attention
    proj, conv, normed = buffers.delta_proj, buffers.delta_conv, buffers.delta_out
    linear(h, w.in_proj, proj)
    cd, vd, nv = la.conv_dim, la.value_dim, la.num_value_heads
    mixed, z = proj[:, :cd], proj[:, cd : cd + vd]
    b, a = proj[:, cd + vd : cd + vd + nv], proj[:, cd + vd + nv :]
    slots, eps = batch.state_slots, c.rms_norm_eps
    if batch.decode_only and not batch.spec_groups:  # decode rows alone: nothing to slice
        ops.conv(mixed, state.conv, slots, w.conv, conv)
        ops.step(la, w, eps, conv, b, a, z, state.recurrent, slots, normed)
        linear(normed, w.out_proj, out)
        return
    window = kv_window(len(batch.spec_groups), max(n for _, n in batch.spec_groups)) \
        if batch.spec_groups else None
    for grp, (s, e) in _decode_runs(batch):
        if grp is None:  # plain decode rows: batched, their states updated in their slots
            ops.conv(mixed[s:e], state.conv, slots[s:e], w.conv, conv[s:e])
            ops.step(la, w, eps, conv[s:e], b[s:e], a[s:e], z[s:e], state.recurrent, slots[s:e], normed[s:e])
            continue
        pools = LayerState(window.conv[grp][: e - s], window.recurrent[grp][: e - s])
        for j, idx in _positions(pools, state, slots[s : s + 1]):
            r = slice(s + j, s + j + 1)
            ops.conv(mixed[r], pools.conv, idx, w.conv, conv[r])
            ops.step(la, w, eps, conv[r], b[r], a[r], z[r], pools.recurrent, idx, normed[r])
    for r, start, length in _prompt_spans(batch):  # prompt chunks: the chunked rule from the slot's state
        e = start + length
        ops.prompt(la, w, eps, mixed[start:e], b[start:e], a[start:e], z[start:e], state, slots, r,
                   conv[start:e], normed[start:e])
    linear(normed, w.out_proj, out)


class DeltaNetOps:
    """The layer's conv and delta rule over slots of the state pools, natively (``csrc/gated_delta.cpp``
    for decode rows, ``csrc/gated_delta_prompt.cpp`` for prompt chunks: each state read and written
    where it lies, in one pass) or in torch (gathered, computed, scattered back). A speculating
    request's positions go through the decode calls, so its tokens are those of plain decode."""

    def __init__(self, native=None):
        self.native = native

    def conv(self, x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
             out: torch.Tensor) -> None:
        """Decode rows: ``out`` [n, C] = SiLU(conv) of each row's one new input ``x`` [n, C]."""
        if self.native is not None:
            self.native.conv_decode(x, pool, slots, weight, out)
            return
        out[:], new = gated_delta.conv_decode(x, pool.index_select(0, slots), weight)
        pool.index_copy_(0, slots, new)

    def step(self, la, w: LinearAttnWeights, eps: float, conv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
             z: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Decode rows after the conv: the rule's inputs, the rule, the gated norm into ``out`` [n, vd]."""
        if self.native is not None:
            self.native.gated_delta_step(conv, b, a, z, w.neg_a, w.dt_bias, w.norm, eps, la.num_key_heads,
                                         pool, slots, out)
            return
        n, nv = conv.shape[0], la.num_value_heads
        q, k, v, g, beta = gated_delta.rule_inputs(conv, b, a, w.neg_a, w.dt_bias, la)
        core, new = gated_delta.recurrent(q, k, v, g, beta, pool.index_select(0, slots))
        pool.index_copy_(0, slots, new)
        out[:] = gated_delta.gated_norm(core, z.reshape(n, nv, -1), w.norm, eps, out.dtype).reshape(n, -1)

    def prompt(self, la, w: LinearAttnWeights, eps: float, mixed: torch.Tensor, b: torch.Tensor,
               a: torch.Tensor, z: torch.Tensor, state: LayerState, slots: torch.Tensor, row: int,
               conv: torch.Tensor, out: torch.Tensor) -> None:
        """One sequence's prompt chunk (launch row ``row``, its state in slot ``slots[row]``): the conv
        into ``conv`` [L, C], the chunked rule and the gated norm into ``out`` [L, vd]."""
        if self.native is not None and la.key_head_dim % self.native.VL == 0 \
                and la.value_head_dim % self.native.VL == 0:
            self.native.conv_prompt(mixed, state.conv, slots, row, w.conv, conv)
            self.native.gated_delta_prompt(conv, b, a, z, w.neg_a, w.dt_bias, w.norm, eps, la.num_key_heads,
                                           state.recurrent, slots, row, out)
            return
        length, one = mixed.shape[0], slots[row : row + 1]
        conv_state = state.conv[one][0]  # copies: written back below
        conv[:] = gated_delta.conv_prompt(mixed, conv_state, w.conv)
        state.conv.index_copy_(0, one, conv_state.unsqueeze(0))
        q, k, v, g, beta = gated_delta.rule_inputs(conv, b, a, w.neg_a, w.dt_bias, la)
        core, new = gated_delta.chunked(q, k, v, g, beta, state.recurrent[one][0])
        state.recurrent.index_copy_(0, one, new.unsqueeze(0))
        out[:] = gated_delta.gated_norm(core, z.reshape(length, la.num_value_heads, -1), w.norm, eps,
                                        out.dtype).reshape(length, -1)


def _positions(pools: LayerState, state: LayerState, slot: torch.Tensor):
    """A speculating request's positions j: its states after j rows are carried into ``pools[j]``,
    which position j's step then advances in place (yields j and the index of ``pools[j]``)."""
    pools.conv[0] = state.conv.index_select(0, slot)[0]
    pools.recurrent[0] = state.recurrent.index_select(0, slot)[0]
    index = torch.arange(pools.conv.shape[0], device=pools.conv.device)  # one tensor, a view per position
    for j in range(pools.conv.shape[0]):
        if j:
            pools.conv[j], pools.recurrent[j] = pools.conv[j - 1], pools.recurrent[j - 1]
        yield j, index[j : j + 1]


def _decode_runs(batch: ForwardBatch) -> list[tuple[int | None, tuple[int, int]]]:
    """The decode rows as runs: (None, (start, end)) of plain rows, (group, (first, end)) of a
    speculating request's rows."""
    runs, row = [], 0
    groups = {first: (i, n) for i, (first, n) in enumerate(batch.spec_groups)}
    while row < batch.num_decode:
        if row in groups:
            i, n = groups[row]
            runs.append((i, (row, row + n)))
            row += n
            continue
        end = row + 1
        while end < batch.num_decode and end not in groups:
            end += 1
        runs.append((None, (row, end)))
        row = end
    return runs


def _prompt_spans(batch: ForwardBatch) -> list[tuple[int, int, int]]:
    """(row, first token, tokens) of each prompt chunk, from the launch's host lists."""
    spans, start = [], batch.num_decode
    for i, length in enumerate(batch.prompt_query_lens):
        spans.append((batch.num_decode + i, start, length))
        start += length
    return spans

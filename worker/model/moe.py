"""A Qwen3-MoE layer's MLP: the router, then the experts by one of three paths.

- Many tokens on the CPU: expert by expert in index order, one GEMM of the tokens routed to it
  (grouped on the host from one read of the routing, or by a sort on the device for many).
- One token (decode of one row): its k experts, the routing read once, no gather or scatter.
- CUDA, where ``torch._grouped_mm`` runs: every (token, expert) pair in two grouped GEMMs, sorted
  on the device, nothing read back (``Kernels.grouped_moe``).

Each adds the experts' outputs in the same order, so the paths agree with transformers.
"""

from __future__ import annotations

import torch

from fusedserve.kernels.backend_table import Kernels
from fusedserve.kernels.model_description.config import Qwen3Config


def moe_forward(c: Qwen3Config, kernels: Kernels, lw, h: torch.Tensor, out: torch.Tensor) -> None:
    """A Qwen3-MoE layer's MLP over n tokens, as transformers computes it: the router's
    softmax (float32), each token's top-k experts (their weights renormalised with
    ``norm_topk_prob``), then, expert by expert in index order, one GEMM of every token
    routed to it, scaled by its weight and added into ``out`` [n, D].

    The tokens of each expert are known only from the router's output, so this reads the
    routing back to the host (on a CPU that is no copy; a device graph cannot capture it)."""
    ops, linear = kernels.ops, kernels.linear
    n, k, mi = h.shape[0], c.num_experts_per_tok, c.moe_intermediate_size
    logits = torch.empty(n, c.num_experts, dtype=h.dtype, device=h.device)
    linear(h, lw.router, logits)
    weights, ids = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    if c.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    weights = weights.to(h.dtype)
    if lw.expert_stack is not None:
        _experts_grouped(c, kernels, lw, h, out, weights, ids)
        return
    if n == 1:  # decode of one row: k experts, the routing read once, no gather or scatter
        _experts_one_row(c, kernels, lw, h, out, ids[0].tolist(), weights[0].tolist())
        return
    weights = weights.flatten()
    out.zero_()
    for e, rows, slots in _by_expert(ids, c.num_experts):
        if lw.experts[e] is None:  # held by another rank (expert parallelism)
            continue
        gate_up, down = lw.experts[e]
        count = rows.shape[0]
        x = h.index_select(0, rows)
        gu = torch.empty(count, 2 * mi, dtype=h.dtype, device=h.device)
        linear(x, gate_up, gu)
        act = torch.empty(count, mi, dtype=h.dtype, device=h.device)
        ops.silu_mul(gu, act)
        y = torch.empty(count, c.hidden_size, dtype=h.dtype, device=h.device)
        linear(act, down, y)
        y.mul_(weights.index_select(0, slots)[:, None])
        out.index_add_(0, rows, y)


def _experts_one_row(c: Qwen3Config, kernels: Kernels, lw, h: torch.Tensor, out: torch.Tensor,
                     experts: list[int], weights: list[float]) -> None:
    """One token's experts, in index order (as the batched path adds them), into ``out`` [1, D]."""
    ops, linear = kernels.ops, kernels.linear
    mi = c.moe_intermediate_size
    kw = {"dtype": h.dtype, "device": h.device}
    gu, act = torch.empty(1, 2 * mi, **kw), torch.empty(1, mi, **kw)
    y = torch.empty(1, c.hidden_size, **kw)
    out.zero_()
    for e, w in sorted(zip(experts, weights)):
        if lw.experts[e] is None:
            continue
        gate_up, down = lw.experts[e]
        linear(h, gate_up, gu)
        ops.silu_mul(gu, act)
        linear(act, down, y)
        out.add_(y.mul_(w))


def _experts_grouped(c: Qwen3Config, kernels: Kernels, lw, h: torch.Tensor, out: torch.Tensor,
                     weights: torch.Tensor, ids: torch.Tensor) -> None:
    """Every routed (token, expert) pair in two grouped GEMMs: the pairs sorted by expert on the
    device, one ``torch._grouped_mm`` for gate/up and one for down over each expert's run, then
    each token's k outputs summed in its routing order. Nothing is read back to the host and
    every shape follows n alone, so a device graph could capture it."""
    ops = kernels.ops
    n, k = ids.shape
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(c.num_experts, dtype=torch.int32, device=h.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount would sync
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate_up, down = lw.expert_stack
    gu = torch._grouped_mm(h.index_select(0, order // k), gate_up.transpose(-2, -1), offs=offs)
    act = torch.empty(n * k, c.moe_intermediate_size, dtype=h.dtype, device=h.device)
    ops.silu_mul(gu, act)
    y = torch._grouped_mm(act, down.transpose(-2, -1), offs=offs)
    y.mul_(weights.flatten().index_select(0, order)[:, None])
    slots = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, k) order, deterministic
    torch.sum(slots.view(n, k, c.hidden_size), dim=1, out=out)


def _by_expert(ids: torch.Tensor, num_experts: int):
    """For each expert with tokens, in index order: (expert, token rows [m], routing slots [m])
    of the tokens routed to it; ``ids`` [n, k] are each token's experts. Few slots (decode) are
    grouped on the host from one read; many (prefill) by a sort on the device."""
    n, k = ids.shape
    if n * k <= 256:
        groups: dict[int, list[int]] = {}
        for slot, e in enumerate(ids.flatten().tolist()):
            groups.setdefault(e, []).append(slot)
        for e in sorted(groups):
            slots = torch.tensor(groups[e], device=ids.device)
            yield e, slots // k, slots
        return
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    start = 0
    for e, count in enumerate(counts):
        if count:
            slots = order[start : start + count]
            yield e, slots // k, slots
            start += count

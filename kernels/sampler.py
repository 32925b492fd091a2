"""Sampling of every kind on the device: each row hands back only its token id.

Per row: temperature, top-k, top-p (over the renormalised top-k set), min-p, then one
draw by inverse CDF over the kept tokens in id order, from a uniform number hashed from
(seed, step). The draw depends only on the row's logits and (seed, step): not on the
batch a request lands in, and a re-run (preemption, a lost worker) draws the same token.
Logprobs are the model's full-vocabulary log-softmax, as OpenAI reports them.
Ties at the k-th value (top-k) or at the top-p cut-off are all kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _lsr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical shift right of int64 (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _lsr(z, 30)) * _M1
    z = (z ^ _lsr(z, 27)) * _M2
    return z ^ _lsr(z, 31)


def uniform(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """One float64 in (0, 1) per row from int64 (seed, step): a counter-based hash."""
    z = _mix(_mix(seeds * _GOLDEN + 1) + steps * _GOLDEN)
    return (_lsr(z, 11).to(torch.float64) + 0.5) / float(1 << 53)


@dataclass
class RowParams:
    """Per-row sampling settings on the device: ``f32`` [B, 4] = (temperature, top_p, min_p,
    top_k); ``seeds`` [B, 2] int64 = (seed, step)."""

    f32: torch.Tensor
    seeds: torch.Tensor


def sample(logits: torch.Tensor, p: RowParams, out: torch.Tensor, argmax_done: bool = False) -> torch.Tensor:
    """Write each row's token into ``out`` [B] int32; greedy rows take the argmax (already
    there when ``argmax_done``: the fused step wrote it)."""
    b, vocab = logits.shape
    t, top_p, min_p = p.f32[:, 0], p.f32[:, 1], p.f32[:, 2]
    top_k = p.f32[:, 3].to(torch.int64)
    if not argmax_done:
        out.copy_(torch.argmax(logits, dim=-1))
    rows = torch.nonzero(t > 0).flatten()
    if rows.numel() == 0:
        return out
    x = logits.index_select(0, rows).double() / t[rows, None].double()
    k = top_k[rows]
    if bool(((k > 0) & (k < vocab)).any()):
        kk = torch.where((k > 0) & (k < vocab), k, torch.full_like(k, vocab))
        kth = torch.topk(x, int(kk.max()), dim=-1).values.gather(1, (kk - 1)[:, None])
        x = torch.where(x < kth, torch.full_like(x, float("-inf")), x)
    probs = torch.softmax(x, dim=-1)
    tp = top_p[rows].double()
    for i in torch.nonzero(tp < 1.0).flatten().tolist():  # rows asking for top-p
        srt = torch.sort(probs[i], descending=True).values
        keep = int(torch.searchsorted(torch.cumsum(srt, 0), tp[i:i + 1]).item()) + 1
        cut = srt[min(keep, vocab) - 1]
        probs[i] = torch.where(probs[i] < cut, torch.zeros_like(probs[i]), probs[i])
    mp = min_p[rows].double()
    if bool((mp > 0).any()):
        floor = mp[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(probs < floor, torch.zeros_like(probs), probs)
    cum = torch.cumsum(probs, dim=-1)
    u = uniform(p.seeds[rows, 0], p.seeds[rows, 1])[:, None] * cum[:, -1:]
    ids = torch.searchsorted(cum, u, right=True).clamp_(max=vocab - 1).flatten()
    out.index_copy_(0, rows, ids.to(out.dtype))
    return out


def logprobs(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, n: int,
             sampled: torch.Tensor, top_ids: torch.Tensor, top_values: torch.Tensor) -> None:
    """For ``rows``: the sampled token's full-vocabulary logprob into ``sampled`` [R], and the
    ``n`` most likely tokens' into ``top_ids``/``top_values`` [R, n]."""
    if rows.numel() == 0:
        return
    lsm = torch.log_softmax(logits.index_select(0, rows).double(), dim=-1)
    sampled.copy_(lsm.gather(1, tokens.index_select(0, rows).to(torch.int64)[:, None]).flatten())
    if n:
        v, i = torch.topk(lsm, n, dim=-1)
        top_values.copy_(v)
        top_ids.copy_(i)

"""The sampler: every kind of sampling on the device, each row handing back only its token id.

Per row: temperature, top-k, top-p (over the renormalised top-k set), min-p, then one draw
by inverse CDF over the kept tokens in id order, from a uniform number hashed from
(seed, step). Temperature 0 is greedy (the argmax). A draw depends only on the row's logits
and (seed, step): not on the batch a request lands in, and a re-run (preemption, a lost
worker) draws the same token. Ties at the k-th value (top-k) or at the top-p cut-off are
all kept. Logprobs are the model's full-vocabulary log-softmax, as OpenAI reports them.

Nothing here reads a device value on the host (no ``nonzero``, ``item``, ``tolist``,
``bool(tensor)`` or loop over rows): every op has a shape fixed by the batch, so a CUDA
graph can capture it. Which stages run is the launch's ``SamplingPlan``, known on the host
from the requests' settings. The top-k and top-p thresholds are found exactly by a radix
select over the whole row (four passes of 256-bin histograms), never by sorting it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from fusedserve.shared_memory.sampling_row import MIN_P, TEMPERATURE, TOP_K, TOP_P, SamplingPlan, row_paths

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic).
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
# Probabilities as fixed-point integers (units of 2^-40): sums are exact, so a threshold never
# depends on the order a device adds them in (CUDA's scatter_add is unordered).
_FIXED = float(1 << 40)


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


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """float32 values as int32 keys that sort (signed) as the values do."""
    bits = x.contiguous().view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _radix_select(keys: torch.Tensor, weights: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the largest key ``c`` with ``sum(weights[keys >= c]) >= target``.

    keys: [B, V] int32; weights: [B, V] int64 >= 0; target: [B] int64. Four passes of eight
    bits each (a 256-bin histogram per row): the weight of each next digit among the keys that
    share the digits chosen so far, then the highest digit that still reaches the target.
    Returns [B] int32.
    """
    b, dev = keys.shape[0], keys.device
    u = keys.to(torch.int64) + (1 << 31)  # unsigned order, in [0, 2^32)
    in_range = torch.ones_like(u, dtype=torch.bool)
    answer = torch.zeros(b, dtype=torch.int64, device=dev)
    above = torch.zeros(b, dtype=torch.int64, device=dev)  # weight of keys above the answer's range
    pad = torch.zeros(b, 1, dtype=torch.int64, device=dev)
    for shift in (24, 16, 8, 0):
        digit = (u >> shift) & 255
        w = weights if shift == 24 else torch.where(in_range, weights, 0)
        hist = torch.zeros(b, 256, dtype=torch.int64, device=dev).scatter_add_(1, digit, w)
        at_least = torch.cat([hist.flip(1).cumsum(1).flip(1), pad], 1) + above[:, None]
        d = (at_least[:, :256] >= target[:, None]).sum(1).sub_(1).clamp_(min=0)
        above = at_least.gather(1, (d + 1)[:, None]).squeeze(1)
        answer = (answer << 8) | d
        if shift:
            in_range &= digit == d[:, None]
    return (answer - (1 << 31)).to(torch.int32)


def _full_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """True where a token is among its row's ``top_k`` largest (ties kept; 0 or >= vocab: all)."""
    vocab = logits.shape[1]
    keys = _order_keys(logits)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    kth = _radix_select(keys, torch.ones_like(keys, dtype=torch.int64), k)
    return keys >= kth[:, None]


def _full_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """True where a token is in its row's smallest most-likely set holding ``top_p`` of the mass
    (every token tied with the last one kept); rows with ``top_p >= 1`` keep every token."""
    keys = probs.view(torch.int32)  # float32 probabilities are >= 0: their bits sort
    w = (probs * _FIXED).to(torch.int64)  # exact above 2^-17; the rest truncated to 2^-40
    # At least the most likely token, also for a top_p that underflowed in float32.
    target = torch.ceil(top_p.double() * w.sum(1).double()).to(torch.int64).clamp_(min=1)
    cut = _radix_select(keys, w, target)
    return (keys >= cut[:, None]) | (top_p >= 1.0)[:, None]


def _scaled(logits: torch.Tensor, top: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``(logits - max) / t``: <= 0 for any t > 0, so a tiny t gives -inf (probability 0) and the
    max keeps 0, never inf - inf."""
    return (logits - top) / torch.where(t > 0, t, 1.0)[:, None]


def _draw(probs: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Inverse CDF over each row's probabilities (in the order given) at its hashed uniform."""
    cum = torch.cumsum(probs.double(), dim=-1)
    u = uniform(seeds[:, 0], seeds[:, 1])[:, None] * cum[:, -1:]
    return torch.searchsorted(cum, u, right=True).clamp_(max=probs.shape[1] - 1).squeeze(1)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    return torch.where(probs >= min_p[:, None] * top, probs, 0.0)


def _candidate_draw(logits: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor, n: int) -> torch.Tensor:
    """Rows whose top_k is within the ``n`` candidates: every stage over the candidates alone."""
    t = params[:, TEMPERATURE]
    vals, ids = torch.topk(logits, n, dim=-1)  # descending
    k = params[:, TOP_K].to(torch.int64).clamp(1, n)
    vals = torch.where(vals >= vals.gather(1, (k - 1)[:, None]), vals, float("-inf"))
    probs = torch.softmax(_scaled(vals, vals[:, :1], t), dim=-1)
    cum = torch.cumsum(probs.double(), dim=-1)  # most likely first: top-p keeps a prefix
    top_p = params[:, TOP_P]
    keep = ((cum - probs.double()) < top_p.double()[:, None]) | (top_p >= 1.0)[:, None]
    keep[:, 0] = True  # the most likely token, also for a top_p that underflowed in float32
    cut = torch.where(keep, probs, float("inf")).amin(dim=-1, keepdim=True)
    probs = torch.where(probs >= cut, probs, 0.0)
    probs = _min_p(probs, params[:, MIN_P], probs[:, :1])
    order = torch.argsort(ids, dim=-1)  # the draw runs over token ids in ascending order
    pick = _draw(probs.gather(1, order), seeds)
    return ids.gather(1, order.gather(1, pick[:, None])).squeeze(1)


def _full_draw(logits: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor,
               plan: SamplingPlan) -> torch.Tensor:
    """Rows sampled over the whole vocabulary."""
    x = _scaled(logits, logits.amax(dim=-1, keepdim=True), params[:, TEMPERATURE])
    if plan.wide_top_k:
        x = torch.where(_full_top_k(logits, params[:, TOP_K].to(torch.int64)), x, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if plan.top_p:
        probs = torch.where(_full_top_p(probs, params[:, TOP_P]), probs, 0.0)
    if plan.min_p:
        probs = _min_p(probs, params[:, MIN_P], probs.amax(dim=-1, keepdim=True))
    return _draw(probs, seeds)


def bit_table(device: torch.device | str) -> torch.Tensor:
    """[256, 8] bool: the bits of each byte value, lowest first (``allowed_tokens``' lookup)."""
    return ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool().to(device)


def allowed_tokens(bitmask: torch.Tensor, vocab: int, table: torch.Tensor) -> torch.Tensor:
    """A grammar's token bitmask [B, ceil(V / 32)] int32 (bit v % 32 of word v // 32 allows
    token v) as [B, V] bool: one lookup per byte in ``bit_table`` (little-endian words, as
    x86, Arm and CUDA store them, so token v is bit v % 8 of byte v // 8)."""
    b = bitmask.shape[0]
    return table[bitmask.view(torch.uint8).long()].view(b, -1)[:, :vocab]


class Sampler(Protocol):
    """``sample``'s signature: each backend's sampler takes it (``kernels/backend_table.py``)."""

    def __call__(self, logits: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor, out: torch.Tensor,
                 plan: SamplingPlan, candidates: int) -> torch.Tensor: ...


def sample(logits: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor, out: torch.Tensor,
           plan: SamplingPlan, candidates: int) -> torch.Tensor:
    """Write each row's token into ``out`` [B] int32.

    logits: [B, V] float32; params: [B, 4] float32 (temperature, top_p, min_p, top_k);
    seeds: [B, 2] int64 (seed, step). A row with temperature > 0 and ``1 <= top_k <=
    candidates`` is sampled among its ``candidates`` most likely tokens (which hold its
    whole top-k set); any other stochastic row over the whole vocabulary. Rows under a grammar
    come with their refused tokens already at -inf (``apply_token_bitmask``).
    """
    token = torch.argmax(logits, dim=-1)
    if plan.random:  # else every row is greedy: the row masks' few small ops are skipped
        t, k = params[:, TEMPERATURE], params[:, TOP_K]
        n = min(candidates, logits.shape[1])
        in_candidates, in_full = row_paths(t, k, n)
        if plan.candidates:
            token = torch.where(in_candidates, _candidate_draw(logits, params, seeds, n), token)
        if plan.full:
            token = torch.where(in_full, _full_draw(logits, params, seeds, plan), token)
    out.copy_(token)
    return out


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, lp_out: torch.Tensor,
                   top_ids_out: torch.Tensor, top_values_out: torch.Tensor) -> None:
    """For each row of ``logits`` [R, V]: the full-vocabulary logprob of ``tokens`` [R] into
    ``lp_out`` [R], and the ``n`` most likely tokens' into ``top_*_out`` [R, n] (n may be 0)."""
    lsm = torch.log_softmax(logits.double(), dim=-1)
    lp_out.copy_(lsm.gather(1, tokens.to(torch.int64)[:, None]).squeeze(1))
    n = top_ids_out.shape[1]
    if n:
        v, i = torch.topk(lsm, n, dim=-1)
        top_values_out.copy_(v)
        top_ids_out.copy_(i)

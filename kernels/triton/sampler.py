"""The every-stage sampler as a few Triton kernels (CUDA): the draws of ``fusedserve.kernels.sampler``
without its ~290 ATen ops.

The same rules, the same hash, the same thresholds, found the same way: top-k (beyond the
candidates) and top-p keep every token whose order key is at least the largest key ``c`` with
``sum(weight[key >= c]) >= target``; the draw is the inverse CDF over the kept tokens in id
order at the (seed, step) uniform. What changes is how the work is laid out:

- ``torch.topk`` once per launch gives every row its ``n`` candidates and its max logit;
- ``_row_kernel`` (a program per row) draws a candidate-path row entirely in registers, and
  for a full-path row finds the top-p cut among the candidates, which holds whenever their
  mass reaches the target; only a row where it does not, or with a top-k beyond the
  candidates, runs the radix select over its whole row (``_select_hist_kernel``: four rounds
  of 256-bin histograms, each (row, tile) program adding its tile's into the row's with
  integer atomics; ``_select_done_kernel`` reads the answer), the other rows' programs exit
  at once;
- full-path rows' softmax sums, top-p weights and draw mass are per-tile partials over
  ``(row, vocabulary tile)`` programs, added in tile order (deterministic).

Every kernel has a shape fixed by the batch and reads nothing back to the host, so a CUDA
graph captures it. The integers that vary with the batch and vocabulary are not specialised on
and a row's partials are read at one width (``NC_P``), so each kernel compiles once per
constant set, not once per bucket or model. Greedy rows and rows off a kernel's path are left
alone by it, so a row draws the same under any ``SamplingPlan``. Probabilities can differ from
ATen's softmax in the last bit (``exp`` and summation order), so a draw within ~1e-7 of a
boundary may differ between the two samplers; within this one, the same inputs give the same
token.
Tested under ``TRITON_INTERPRET=1`` against ``fusedserve.kernels.sampler``
(tests/kernels/test_triton_kernels.py).
"""

from __future__ import annotations

import os

import torch

import triton
import triton.language as tl
from fusedserve.kernels import sampler as reference
from fusedserve.shared_memory import sampling_row
from fusedserve.shared_memory.sampling_row import SamplingPlan

BLOCK = 1024  # vocabulary tile of the per-(row, tile) kernels
NC_P = 256  # tiles a row's partials are read as: vocabularies up to 262,144 tokens, one compile for all
# Keys per one-hot histogram step: a [SUB, 256] tile in registers on a GPU; the interpreter runs
# numpy per step, so it takes 256 (four steps a tile, the loop still exercised).
SUB = 256 if os.environ.get("TRITON_INTERPRET") == "1" else 32
_M1 = tl.constexpr(reference._M1)
_M2 = tl.constexpr(reference._M2)
_GOLDEN = tl.constexpr(reference._GOLDEN)
_FIXED = tl.constexpr(reference._FIXED)
# The row layout of the sampling_params slot (shared_memory/sampling_row.py).
_WIDTH = tl.constexpr(len(sampling_row.COLUMNS))
_TEMPERATURE = tl.constexpr(sampling_row.TEMPERATURE)
_TOP_P = tl.constexpr(sampling_row.TOP_P)
_MIN_P = tl.constexpr(sampling_row.MIN_P)
_TOP_K = tl.constexpr(sampling_row.TOP_K)
_NO_CUT = tl.constexpr(-1)  # a top-p row whose cut the candidates could not place


@triton.jit
def _lsr(z, s: tl.constexpr):
    return (z >> s) & ((1 << (64 - s)) - 1)


@triton.jit
def _mix(z):
    z = (z ^ _lsr(z, 30)) * _M1
    z = (z ^ _lsr(z, 27)) * _M2
    return z ^ _lsr(z, 31)


@triton.jit
def _uniform(seed, step):
    """``fusedserve.kernels.sampler.uniform``: int64 wrap-around arithmetic, the same bits."""
    z = _mix(_mix(seed * _GOLDEN + 1) + step * _GOLDEN)
    return (_lsr(z, 11).to(tl.float64) + 0.5) / 9007199254740992.0


@triton.jit
def _order_key(x):
    """float32 -> int32 keys that sort (signed) as the values do."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _key(x):
    """float32 -> int64 keys in [0, 2^32) that sort as the values do (0: below every value)."""
    return _order_key(x).to(tl.int64) + 2147483648


@triton.jit
def _row(params_ptr, b, n, V):
    """A row's settings and path (``fusedserve.kernels.sampler.row_paths``)."""
    t = tl.load(params_ptr + b * _WIDTH + _TEMPERATURE)
    top_p = tl.load(params_ptr + b * _WIDTH + _TOP_P)
    min_p = tl.load(params_ptr + b * _WIDTH + _MIN_P)
    k = tl.load(params_ptr + b * _WIDTH + _TOP_K)
    random = t > 0
    cand = random & (k >= 1) & (k <= n)
    full = random & (k < 1) | random & (k > n)
    wide = full & (k > n) & (k < V)
    return t, top_p, min_p, k, cand, full, wide


@triton.jit
def _probs(x, M, t, S, kth, mask):
    """A full-path row's probabilities over a tile of its logits ``x``: 0 outside its top-k."""
    keep = mask & (_key(x) >= kth)
    return tl.where(keep, tl.exp((x - M) / t) / S, 0.0)


@triton.jit
def _total(part_ptr, b, NC, NC_P: tl.constexpr):
    """The sum of a row's per-tile partials, in one fixed order (every kernel gets the same S)."""
    c = tl.arange(0, NC_P)
    return tl.sum(tl.load(part_ptr + b * NC + c, mask=c < NC, other=0), axis=0)


@triton.jit(do_not_specialize=["V", "stride_l", "n", "NC"])
def _sum_kernel(logits_ptr, params_ptr, topv_ptr, kth_ptr, sums_ptr, part_ptr, V, stride_l, n, NC,
                WEIGHTS: tl.constexpr, NC_P: tl.constexpr, BLOCK: tl.constexpr):
    """Per (row, tile) of a full-path row: the softmax sum's partial into ``part_ptr`` (``WEIGHTS``
    False), or, for a top-p row, the partial of its top-p weights ``floor(p * 2^40)`` (True)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    t, top_p, min_p, k, cand, full, wide = _row(params_ptr, b, n, V)
    need = full
    if WEIGHTS:
        need = full & (top_p < 1.0)
    if need:
        M = tl.load(topv_ptr + b * n)
        kth = tl.load(kth_ptr + b)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(logits_ptr + b * stride_l + offs, mask=mask, other=float("-inf"))
        if WEIGHTS:
            p = _probs(x, M, t, _total(sums_ptr, b, NC, NC_P), kth, mask)
            tl.store(part_ptr + b * NC + c, tl.sum((p * _FIXED).to(tl.int64), axis=0))
        else:
            e = tl.where(mask & (_key(x) >= kth), tl.exp((x - M) / t), 0.0)
            tl.store(part_ptr + b * NC + c, tl.sum(e, axis=0))


@triton.jit
def _select_need(params_ptr, cut_ptr, b, n, V, CUT: tl.constexpr):
    """Whether row ``b`` takes part in a select: a top-k beyond the candidates (``CUT`` False), or
    a top-p row whose cut the candidates could not place (True)."""
    t, top_p, min_p, k, cand, full, wide = _row(params_ptr, b, n, V)
    if CUT:
        need = full & (top_p < 1.0) & (tl.load(cut_ptr + b) == _NO_CUT)
    else:
        need = wide
    return need, t, k


@triton.jit
def _select_state(hist_ptr, b, B, target, ROUNDS: tl.constexpr):
    """The radix select after ``ROUNDS`` of its four rounds (``fusedserve.kernels.sampler._radix_select``):
    the digits chosen so far as a prefix, and the weight of the keys above the prefix's range."""
    d = tl.arange(0, 256)
    prefix = tl.zeros((), tl.int64)
    above = tl.zeros((), tl.int64)
    for r in tl.static_range(ROUNDS):
        h = tl.load(hist_ptr + (r * B + b) * 256 + d)
        at_least = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h + above  # weight of digits >= d
        digit = tl.maximum(tl.sum((at_least >= target).to(tl.int32), axis=0) - 1, 0)
        after = tl.sum(tl.where(d == digit + 1, at_least, 0), axis=0)
        above = tl.where(digit == 255, above, after)
        prefix = prefix | (digit.to(tl.int64) << (24 - 8 * r))
    return prefix, above


@triton.jit
def _select_target(target_ptr, b, k, CUT: tl.constexpr):
    if CUT:
        target = tl.load(target_ptr + b)
    else:
        target = k.to(tl.int64)
    return target


@triton.jit(do_not_specialize=["V", "stride_l", "n", "NC", "B"])
def _select_hist_kernel(logits_ptr, params_ptr, topv_ptr, kth_ptr, cut_ptr, target_ptr, sums_ptr, hist_ptr,
                        V, stride_l, n, NC, B, ROUND: tl.constexpr, CUT: tl.constexpr, NC_P: tl.constexpr,
                        BLOCK: tl.constexpr, SUB: tl.constexpr):
    """Round ``ROUND`` of the radix select, per (row, tile): the 256-bin histogram of the key's
    digit at bit 24 - 8 * ROUND among the keys that share the digits chosen so far (re-derived
    from the earlier rounds' histograms), added into the row's histogram (int64: any order
    gives the same sums). Keys: the logits' order keys + 2^31, weight 1 (``CUT`` False: the k-th
    largest of a top-k beyond the candidates); the probabilities' bits, weight floor(p * 2^40)
    (True: a top-p cut). Rows outside the select exit at once."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    need, t, k = _select_need(params_ptr, cut_ptr, b, n, V, CUT)
    if need:
        prefix, above = _select_state(hist_ptr, b, B, _select_target(target_ptr, b, k, CUT), ROUND)
        shift: tl.constexpr = 24 - 8 * ROUND
        d = tl.arange(0, 256)
        if CUT:  # the row's probabilities (the k-th select runs before they exist)
            M = tl.load(topv_ptr + b * n)
            S = _total(sums_ptr, b, NC, NC_P)
            kth = tl.load(kth_ptr + b)
        hist = tl.zeros([256], tl.int64)
        for sub in range(0, BLOCK, SUB):
            offs = c * BLOCK + sub + tl.arange(0, SUB)
            mask = offs < V
            x = tl.load(logits_ptr + b * stride_l + offs, mask=mask, other=float("-inf"))
            if CUT:
                p = _probs(x, M, t, S, kth, mask)
                key = p.to(tl.int32, bitcast=True).to(tl.int64)
                w = (p * _FIXED).to(tl.int64)
            else:
                key = _key(x)
                w = mask.to(tl.int64)
            w = tl.where((key >> (shift + 8)) == (prefix >> (shift + 8)), w, 0)
            digit = (key >> shift) & 255
            hist += tl.sum(tl.where(digit[:, None] == d[None, :], w[:, None], 0), axis=0)
        tl.atomic_add(hist_ptr + (ROUND * B + b) * 256 + d, hist)


@triton.jit(do_not_specialize=["V", "n", "B"])
def _select_done_kernel(params_ptr, kth_ptr, cut_ptr, target_ptr, hist_ptr, V, n, B, CUT: tl.constexpr):
    """The select's answer from its four histograms, a program per row: the cut's key, or the
    k-th key."""
    b = tl.program_id(0)
    need, t, k = _select_need(params_ptr, cut_ptr, b, n, V, CUT)
    if need:
        key, above = _select_state(hist_ptr, b, B, _select_target(target_ptr, b, k, CUT), 4)
        if CUT:
            tl.store(cut_ptr + b, key)
        else:
            tl.store(kth_ptr + b, key)


@triton.jit(do_not_specialize=["V", "n", "NC"])
def _row_kernel(params_ptr, seeds_ptr, topv_ptr, topi_ptr, kth_ptr, cut_ptr, target_ptr, sums_ptr,
                weights_ptr, out_ptr, V, n, NC, TOP_P: tl.constexpr, N_P: tl.constexpr, NC_P: tl.constexpr):
    """A program per row. Candidate path: top-k, temperature, top-p, min-p and the draw over the
    ``n`` candidates, the token into ``out``. Full path with ``TOP_P``: the target and, where the
    candidates reach it, the cut (else ``_NO_CUT``)."""
    b = tl.program_id(0)
    t, top_p, min_p, k, cand, full, wide = _row(params_ptr, b, n, V)
    j = tl.arange(0, N_P)
    m = j < n
    v = tl.load(topv_ptr + b * n + j, mask=m, other=float("-inf"))  # descending
    if cand:
        ids = tl.load(topi_ptr + b * n + j, mask=m, other=2147483647)
        kk = tl.minimum(tl.maximum(k.to(tl.int32), 1), n)
        kth = tl.max(tl.where(j == kk - 1, v, float("-inf")), axis=0)
        v = tl.where(m & (v >= kth), v, float("-inf"))
        e = tl.exp((v - tl.max(v, axis=0)) / t)
        p = e / tl.sum(e, axis=0)
        p64 = p.to(tl.float64)
        cum = tl.cumsum(p64, axis=0)
        keep = m & (((cum - p64) < top_p.to(tl.float64)) | (j == 0))
        keep = tl.where(top_p >= 1.0, m, keep)
        cut = tl.min(tl.where(keep, p, float("inf")), axis=0)
        p = tl.where(p >= cut, p, 0.0)
        first = tl.max(tl.where(j == 0, p, 0.0), axis=0)
        p = tl.where(p >= min_p * first, p, 0.0)
        # The draw runs over token ids in ascending order: sort (id, probability) pairs by id.
        low = tl.full((), 0xFFFFFFFF, tl.int64)
        pair = tl.sort((ids << 32) | (p.to(tl.int32, bitcast=True).to(tl.int64) & low), 0)
        cum = tl.cumsum((pair & low).to(tl.int32).to(tl.float32, bitcast=True).to(tl.float64), axis=0)
        u = _uniform(tl.load(seeds_ptr + b * 2), tl.load(seeds_ptr + b * 2 + 1))
        pick = tl.minimum(tl.sum((cum <= u * tl.max(cum, axis=0)).to(tl.int32), axis=0), n - 1)
        token = tl.sum(tl.where(j == pick, pair >> 32, 0), axis=0)
        tl.store(out_ptr + b, token.to(tl.int32))
    if TOP_P:
        if full & (top_p < 1.0):
            W = _total(weights_ptr, b, NC, NC_P)
            target = tl.maximum(tl.math.ceil(top_p.to(tl.float64) * W.to(tl.float64)).to(tl.int64), 1)
            p = _probs(v, tl.max(v, axis=0), t, _total(sums_ptr, b, NC, NC_P), tl.load(kth_ptr + b), m)
            cum = tl.cumsum((p * _FIXED).to(tl.int64), axis=0)
            first = tl.sum((cum < target).to(tl.int32), axis=0)  # the first candidate reaching it
            cut = tl.sum(tl.where(j == first, p.to(tl.int32, bitcast=True), 0), axis=0)
            tl.store(cut_ptr + b, tl.where(tl.max(cum, axis=0) >= target, cut, _NO_CUT))
            tl.store(target_ptr + b, target)


@triton.jit
def _kept(x, mask, b, n, t, min_p, topv_ptr, kth_ptr, cut_ptr, sums_ptr, NC, NC_P: tl.constexpr):
    """A full-path row's probabilities after top-k, top-p and min-p (0 where cut)."""
    S = _total(sums_ptr, b, NC, NC_P)
    p = _probs(x, tl.load(topv_ptr + b * n), t, S, tl.load(kth_ptr + b), mask)
    keep = (p.to(tl.int32, bitcast=True).to(tl.int64) >= tl.load(cut_ptr + b)) & (p >= min_p * (1.0 / S))
    return tl.where(keep, p, 0.0)


@triton.jit(do_not_specialize=["V", "stride_l", "n", "NC"])
def _draw_mass_kernel(logits_ptr, params_ptr, topv_ptr, kth_ptr, cut_ptr, sums_ptr, mass_ptr, V, stride_l,
                      n, NC, NC_P: tl.constexpr, BLOCK: tl.constexpr):
    """Per (row, tile) of a full-path row: the mass of its kept tokens (float64)."""
    b = tl.program_id(0)
    c = tl.program_id(1)
    t, top_p, min_p, k, cand, full, wide = _row(params_ptr, b, n, V)
    if full:
        offs = c * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(logits_ptr + b * stride_l + offs, mask=mask, other=float("-inf"))
        p = _kept(x, mask, b, n, t, min_p, topv_ptr, kth_ptr, cut_ptr, sums_ptr, NC, NC_P)
        tl.store(mass_ptr + b * NC + c, tl.sum(p.to(tl.float64), axis=0))


@triton.jit(do_not_specialize=["V", "stride_l", "n", "NC"])
def _draw_kernel(logits_ptr, params_ptr, seeds_ptr, topv_ptr, kth_ptr, cut_ptr, sums_ptr, mass_ptr, out_ptr,
                 V, stride_l, n, NC, NC_P: tl.constexpr, BLOCK: tl.constexpr):
    """A program per full-path row: the tile where the running mass passes u * total, then the
    token inside it (the inverse CDF in id order, as ``fusedserve.kernels.sampler._draw``)."""
    b = tl.program_id(0)
    t, top_p, min_p, k, cand, full, wide = _row(params_ptr, b, n, V)
    if full:
        ci = tl.arange(0, NC_P)
        mass = tl.load(mass_ptr + b * NC + ci, mask=ci < NC, other=0.0)
        run = tl.cumsum(mass, axis=0)
        u = _uniform(tl.load(seeds_ptr + b * 2), tl.load(seeds_ptr + b * 2 + 1))
        target = u * tl.max(run, axis=0)
        tile = tl.minimum(tl.sum((run <= target).to(tl.int32), axis=0), NC - 1)
        before = tl.sum(tl.where(ci < tile, mass, 0.0), axis=0)
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(logits_ptr + b * stride_l + offs, mask=mask, other=float("-inf"))
        p = _kept(x, mask, b, n, t, min_p, topv_ptr, kth_ptr, cut_ptr, sums_ptr, NC, NC_P)
        cum = before + tl.cumsum(p.to(tl.float64), axis=0)
        token = tile * BLOCK + tl.sum((cum <= target).to(tl.int32), axis=0)
        tl.store(out_ptr + b, tl.minimum(token, V - 1))


def _select(logits: torch.Tensor, params: torch.Tensor, topv: torch.Tensor, kth: torch.Tensor,
            cut: torch.Tensor, target: torch.Tensor, sums: torch.Tensor, vocab: int, stride: int, n: int,
            nc: int, b: int, hist: torch.Tensor, top_p: bool) -> None:
    """A radix select over whole rows, for the rows that need it (``top_p``: the cut, else the
    k-th key): four histogram rounds over (row, tile) programs into ``hist`` [4, b, 256] (zeros),
    then each row's answer."""
    for r in range(4):
        _select_hist_kernel[(b, nc)](logits, params, topv, kth, cut, target, sums, hist, vocab, stride, n, nc,
                                     b, ROUND=r, CUT=top_p, NC_P=NC_P, BLOCK=BLOCK, SUB=SUB)
    _select_done_kernel[(b,)](params, kth, cut, target, hist, vocab, n, b, CUT=top_p)


def sample(logits: torch.Tensor, params: torch.Tensor, seeds: torch.Tensor, out: torch.Tensor,
           plan: SamplingPlan, candidates: int) -> torch.Tensor:
    """``fusedserve.kernels.sampler.sample``'s contract: the same arguments and draws (up to the last bit of
    a probability). ``logits`` rows must be contiguous (any row stride)."""
    b, vocab = logits.shape
    out.copy_(torch.argmax(logits, dim=-1))  # greedy rows; the kernels overwrite sampled ones
    if not plan.random or b == 0:
        return out
    if logits.stride(1) != 1 or not (params.is_contiguous() and seeds.is_contiguous()):
        raise ValueError("the Triton sampler takes rows of contiguous logits and contiguous params/seeds")
    dev = logits.device
    n = min(candidates, vocab)
    topv, topi = torch.topk(logits, n, dim=-1)  # descending: the candidates and each row's max
    nc = triton.cdiv(vocab, BLOCK)
    if nc > NC_P:
        raise ValueError(f"the Triton sampler takes vocabularies up to {NC_P * BLOCK} tokens, not {vocab}")
    # One zeroed int64 scratch: per row the top-k key (0 keeps every key) and the top-p cut
    # (0 keeps every probability), the top-p target, and each select's four histograms.
    # Each part starts 16-byte aligned (Triton specialises on pointer alignment: one compile).
    bp = -(-b // 2) * 2
    scratch = torch.zeros(3 * bp + 2 * 4 * b * 256, dtype=torch.int64, device=dev)
    kth, cut, target = scratch[:b], scratch[bp:bp + b], scratch[2 * bp:2 * bp + b]
    hist_kth, hist_cut = scratch[3 * bp:].view(2, 4, b, 256)
    # Written before they are read, for the rows that read them.
    sums = torch.empty(b, nc, dtype=torch.float32, device=dev)
    weights = torch.empty(b, nc, dtype=torch.int64, device=dev)
    rows, tiles, stride = (b,), (b, nc), logits.stride(0)
    select = (logits, params, topv, kth, cut, target, sums, vocab, stride, n, nc, b)
    if plan.wide_top_k:
        _select(*select, hist_kth, top_p=False)
    if plan.full:
        _sum_kernel[tiles](logits, params, topv, kth, sums, sums, vocab, stride, n, nc, WEIGHTS=False,
                           NC_P=NC_P, BLOCK=BLOCK)
        if plan.top_p:
            _sum_kernel[tiles](logits, params, topv, kth, sums, weights, vocab, stride, n, nc, WEIGHTS=True,
                               NC_P=NC_P, BLOCK=BLOCK)
    _row_kernel[rows](params, seeds, topv, topi, kth, cut, target, sums, weights, out, vocab, n, nc,
                      TOP_P=plan.full and plan.top_p, N_P=triton.next_power_of_2(n), NC_P=NC_P)
    if plan.full:
        if plan.top_p:
            _select(*select, hist_cut, top_p=True)
        mass = torch.empty(b, nc, dtype=torch.float64, device=dev)
        _draw_mass_kernel[tiles](logits, params, topv, kth, cut, sums, mass, vocab, stride, n, nc, NC_P=NC_P,
                                 BLOCK=BLOCK)
        _draw_kernel[rows](logits, params, seeds, topv, kth, cut, sums, mass, out, vocab, stride, n, nc,
                           NC_P=NC_P, BLOCK=BLOCK)
    return out

"""Sampling parameters and host-side sampling from device-produced candidates.

The device returns the top-K (values, ids) of each stochastic row; the host applies
temperature, top-k and top-p to them and draws. Candidates serve a request exactly
when its top_k is in 1..K (top-p is then taken over the renormalised top-k set, as
transformers and vLLM do); any other stochastic setting needs the full logits row.
Draws are seeded from (seed, step) so a request recomputed after preemption or a
worker failure draws the same tokens.
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass, field

import numpy as np


class SamplingError(ValueError):
    """Sampling parameters are out of range."""


MAX_TEMPERATURE = 100.0
MAX_TOP_LOGPROBS = 20


def _check_float(name: str, value: object, lo: float, hi: float, lo_open: bool) -> None:
    """A finite, normal (not subnormal) number in [lo, hi] (or (lo, hi] when ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingError(f"{name} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise SamplingError(f"{name} must be finite, got {value!r}")
    if v != 0.0 and abs(v) < sys.float_info.min:
        raise SamplingError(f"{name} is subnormal ({value!r}); use 0 or a normal number")
    if v < lo or v > hi or (lo_open and v == lo):
        bounds = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise SamplingError(f"{name} must be in {bounds}, got {value!r}")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # full-vocabulary logprob of each sampled token
    top_logprobs: int = 0  # and the n most likely tokens' logprobs at each step (implies logprobs)
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise SamplingError(f"max_tokens must be an integer, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise SamplingError(f"max_tokens must be >= 1, got {self.max_tokens}")
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE, lo_open=False)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0, lo_open=False)
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) \
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise SamplingError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], "
                                f"got {self.top_logprobs!r}")
        if self.top_logprobs:
            self.logprobs = True
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise SamplingError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.seed is None:
            self.seed = random.getrandbits(63)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class RowKind:
    """What a row needs back from the device after a launch."""

    GREEDY = "greedy"  # the argmax id
    TOPK = "topk"  # the top-K candidates
    FULL = "full"  # the whole logits row
    DEVICE = "device"  # sampled on the device: the id (and asked-for logprobs)
    INVALID = "invalid"  # its settings could not be sent to the device: the row fails alone


def row_kind(params: SamplingParams, k: int, device_sampling: bool = False) -> str:
    """Classify a request: which device output its next token is drawn from."""
    if device_sampling:
        return RowKind.DEVICE
    if params.logprobs:
        return RowKind.FULL
    if params.greedy:
        return RowKind.GREEDY
    if 1 <= params.top_k <= k:
        return RowKind.TOPK
    return RowKind.FULL


def sample(values: np.ndarray, ids: np.ndarray, params: SamplingParams, step: int) -> int:
    """Draw one token from candidate logits ``values`` (any order) with ids ``ids``.

    Works for top-K candidates and for a full logits row alike (``ids`` = arange).
    """
    if params.greedy:
        best = values.max()
        return int(ids[values == best].min())
    # Ties (common with bf16 logits) break by token id, so candidates and a full
    # logits row order the same tokens the same way.
    order = np.lexsort((ids, -values.astype(np.float64)))
    if params.top_k:
        order = order[: params.top_k]
    # Subtract the max before dividing: (v - max) / t is <= 0 for any t > 0, so a tiny t
    # gives -inf (probability 0), never inf - inf; the max itself keeps probability 1 > 0.
    top = values[order].astype(np.float64)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        scaled = (top - top[0]) / float(params.temperature)
    scaled[~np.isfinite(scaled)] = -np.inf  # -inf logits (masked tokens) stay impossible
    scaled[0] = 0.0
    probs = np.exp(scaled)
    probs /= probs.sum()
    if params.top_p < 1.0:
        cum = np.cumsum(probs)
        keep = int(np.searchsorted(cum, params.top_p, side="left")) + 1
        probs = probs[:keep] / probs[:keep].sum()
        order = order[:keep]
    if params.min_p > 0.0:  # probs are in descending order: keep a prefix
        keep = int(np.count_nonzero(probs >= params.min_p * probs[0]))
        probs = probs[:keep] / probs[:keep].sum()
        order = order[:keep]
    rng = np.random.default_rng([params.seed, step])
    return int(ids[order[int(rng.choice(len(probs), p=probs))]])


def logprob(logits_row: np.ndarray, token: int) -> float:
    """Full-vocabulary log-probability of ``token`` under ``logits_row``."""
    row = logits_row.astype(np.float64)
    m = row.max()
    return float(row[token] - m - np.log(np.exp(row - m).sum()))


def top_logprobs(logits_row: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens and their full-vocabulary log-probabilities, best first
    (ties by token id, as sampling breaks them)."""
    row = logits_row.astype(np.float64)
    m = row.max()
    norm = m + np.log(np.exp(row - m).sum())
    ids = np.lexsort((np.arange(row.shape[0]), -row))[:n]
    return [(int(i), float(row[i] - norm)) for i in ids]

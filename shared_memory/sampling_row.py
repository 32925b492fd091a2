"""One row of the ``sampling_params`` slot: which request setting sits in which column, declared
once here for the coordinator that writes it (``coordinator/engine/batch_io.py``) and every
sampler that reads it (``kernels/sampler.py``, ``kernels/triton/sampler.py``), and the launch's
``SamplingPlan`` that the host derives from the rows and the descriptor carries."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

COLUMNS = ("temperature", "top_p", "min_p", "top_k")  # SamplingParams fields, float32 each
TEMPERATURE, TOP_P, MIN_P, TOP_K = (COLUMNS.index(c) for c in ("temperature", "top_p", "min_p", "top_k"))


def row_values(params: object) -> tuple[float, ...]:
    """A request's settings in the row's column order."""
    return tuple(getattr(params, c) for c in COLUMNS)


def row_paths(t, k, n: int):
    """Which rows take which path, on numpy arrays (the host's plan) or tensors (the device's
    draw) alike: (sampled among the ``n`` candidates, sampled over the whole vocabulary) from
    each row's temperature ``t`` and ``top_k`` ``k``. Greedy rows take neither."""
    random = t > 0
    candidates = random & (k >= 1) & (k <= n)
    return candidates, random & ~candidates


@dataclass(frozen=True)
class SamplingPlan:
    """Which stages a launch runs, from its rows' settings: known on the host when the launch
    is written, never read back. Each row takes the same path whatever the plan, so a draw
    does not depend on the other rows of its batch."""

    candidates: bool = False  # a row with temperature > 0 and 1 <= top_k <= the candidate count
    full: bool = False  # a row with temperature > 0 and any other top_k (0: the whole vocabulary)
    wide_top_k: bool = False  # ... among them, a top_k beyond the candidates (below the vocabulary)
    top_p: bool = False  # a full-path row with top_p < 1
    min_p: bool = False  # a full-path row with min_p > 0

    @property
    def random(self) -> bool:
        return self.candidates or self.full

    @classmethod
    def of(cls, stages: list[str]) -> SamplingPlan:
        """From ``stages()`` (a launch descriptor carries the names)."""
        return cls(**{name: True for name in stages})

    def stages(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name)]

    @classmethod
    def for_rows(cls, params: np.ndarray, candidates: int, vocab: int) -> SamplingPlan:
        """The plan of rows whose ``params`` [B, 4] are laid out as ``COLUMNS``."""
        t, top_p, min_p, k = (params[:, c] for c in (TEMPERATURE, TOP_P, MIN_P, TOP_K))
        if not (t > 0).any():  # greedy rows only (the common launch): no stage to plan
            return cls()
        n = min(candidates, vocab)
        cand, full = row_paths(t, k, n)
        return cls(candidates=bool(cand.any()), full=bool(full.any()),
                   wide_top_k=bool((full & (k > n) & (k < vocab)).any()),
                   top_p=bool((full & (top_p < 1)).any()), min_p=bool((full & (min_p > 0)).any()))

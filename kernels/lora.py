"""LoRA updates of a launch's rows, each row with its own adapter or none.

``add_lora`` is the grouped form of punica's SGMV: the rows of one adapter are gathered, shrunk
through the adapter's stacked A once (``u = x @ A.T``, rank-wide) and each of its parts expanded
through its B straight into its rows and columns of the projection's output (``index_add_``), so
the base projection runs once for the whole launch and an adapter costs two thin products over
its own rows. Rows whose slot is negative use no adapter.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class Part(Protocol):
    rows: slice  # of the projection's output
    cols: slice  # of the shrunk activations
    b: torch.Tensor  # [rows, rank]


class Projection(Protocol):
    a: torch.Tensor  # [sum of ranks, in]
    parts: Sequence[Part]


def add_lora(x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor,
             projections: Sequence[Projection | None]) -> None:
    """``y[t] += B_s A_s x[t]`` for every row ``t`` whose adapter slot ``s = slots[t]`` is >= 0 and
    has an update for this projection (``projections[s]``). ``x``: [T, in]; ``y``: [T, out]."""
    for s, proj in enumerate(projections):
        if proj is None:
            continue
        rows = torch.nonzero(slots == s).squeeze(1)
        if rows.numel() == 0:
            continue
        whole = rows.numel() == x.shape[0]  # every row this adapter's: no gather, no scatter
        xs = x if whole else x.index_select(0, rows)
        u = xs @ proj.a.T
        for part in proj.parts:
            delta = u[:, part.cols] @ part.b.T
            out = y[:, part.rows]
            if whole:
                out.add_(delta)
            else:
                out.index_add_(0, rows, delta)

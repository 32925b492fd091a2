"""LoRA updates of a launch's rows, each row with its own adapter or none.

``add_lora`` is the grouped form of punica's SGMV: the rows of one adapter are gathered, shrunk
through the adapter's stacked A once (``u = x @ A.T``, rank-wide) and each of its parts expanded
through its B straight into its rows and columns of the projection's output (``index_add_``), so
the base projection runs once for the whole launch and an adapter costs two thin products over
its own rows. Rows whose slot is negative use no adapter. Which rows are whose is found once per
launch (``lora_groups``), not per projection.
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


def lora_groups(slots: torch.Tensor, num_slots: int) -> list[tuple[int, torch.Tensor | None]]:
    """Each adapter slot's rows of a launch, found once for all its layers and projections:
    (slot, rows), rows None where every row is that slot's; slots without a row are left out."""
    groups = []
    for s in range(num_slots):
        rows = torch.nonzero(slots == s).squeeze(1)
        if rows.numel():
            groups.append((s, None if rows.numel() == slots.numel() else rows))
    return groups


def add_lora(x: torch.Tensor, y: torch.Tensor, groups: list[tuple[int, torch.Tensor | None]],
             projections: Sequence[Projection | None]) -> None:
    """``y[t] += B_s A_s x[t]`` for every row ``t`` of each group's slot ``s`` (``lora_groups``)
    that has an update for this projection (``projections[s]``). ``x``: [T, in]; ``y``: [T, out]."""
    for s, rows in groups:
        proj = projections[s]
        if proj is None:
            continue
        xs = x if rows is None else x.index_select(0, rows)  # every row this adapter's: no gather
        u = xs @ proj.a.T
        for part in proj.parts:
            delta = u[:, part.cols] @ part.b.T
            out = y[:, part.rows]
            if rows is None:
                out.add_(delta)
            else:
                out.index_add_(0, rows, delta)

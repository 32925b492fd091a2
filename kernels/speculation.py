"""Verifying proposed tokens on the device: keep the longest prefix the target's own draws agree
with, and hand back only the accepted ids and their count.

A speculating request's rows are consecutive decode rows: its newest token, then its proposals
d1..dk (row j's input is d_j), each row at its own position over the request's pages, so row j's
logits are exactly the target's after d1..dj. The sampler has already drawn one token per row
from those logits, at the uniform of (seed, output step + j), as it would without speculation.
Proposal d_{j+1} is accepted while the draw of row j equals it; the first row whose draw differs
gives its draw instead, and a request whose every proposal was accepted also keeps the last row's
draw: 1 + (accepted proposals) tokens.

For a proposer that names one token (n-gram lookup, a draft's argmax: the draft distribution q is
a point mass), this is the standard rejection rule: row j's draw equals d with probability p(d) =
min(1, p(d)/q(d)), and, when it differs, it is distributed as p without d renormalised, which is
the normalised max(0, p - q). So every emitted token follows the target's distribution, and,
because the draws are the ones the non-speculative sampler makes from the same (seed, step), the
tokens are those of a run without speculation, greedy or seeded, whatever the batch.

No host reads and shapes fixed by the launch: a graph may capture it.
"""

from __future__ import annotations

import torch


def request_rows(spec_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each speculating request's first row [S], and which entries of ``spec_rows`` [S, K1] are its
    own rows rather than padding (the padding repeats the first row)."""
    first = spec_rows[:, 0]
    real = spec_rows != first.unsqueeze(1)
    real[:, 0] = True
    return first, real


def accept_prefix(sampled_ids: torch.Tensor, token_ids: torch.Tensor, spec_rows: torch.Tensor,
                  accepted: torch.Tensor) -> None:
    """``spec_rows`` [S, K1]: each speculating request's rows, padded with its first row.
    Writes ``accepted`` [S] (tokens gained: 1 + accepted proposals) and sets ``sampled_ids`` of
    the rows past each request's accepted prefix to -1 (their draws saw a rejected proposal)."""
    first, real = request_rows(spec_rows)
    drawn = sampled_ids.index_select(0, spec_rows.reshape(-1)).view(spec_rows.shape)
    fed = token_ids.index_select(0, spec_rows.reshape(-1)).view(spec_rows.shape)
    agree = (drawn[:, :-1] == fed[:, 1:]) & real[:, 1:]
    gained = torch.cumprod(agree.to(torch.int32), dim=1).sum(dim=1) + 1
    accepted.copy_(gained)
    cols = torch.arange(spec_rows.shape[1], device=spec_rows.device)
    keep = (cols.unsqueeze(0) < gained.unsqueeze(1)) | ~real
    sampled_ids.scatter_(0, spec_rows.reshape(-1), torch.where(keep, drawn, -1).reshape(-1))

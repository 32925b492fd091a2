"""Penalties and logit bias on the device: per-sequence token counts kept where the logits are.

A worker keeps, per penalty slot (a row of state the coordinator assigns each penalized request
while it runs), how often each token appeared in the request's output and in its prompt. A
launch resets the slots of requests starting their first chunk, counts its chunks' tokens into
their slots (prompt or output by position: a recomputed request rebuilds its counts the same way),
applies the penalties to its penalized rows' logits, and counts each sampled token. Every op has
a shape fixed by the launch (index_add over flattened [slot, token] offsets, no masks that select)
and reads nothing back to the host; each row's result depends on its own counts alone.

Formulas: OpenAI's ``logit -= frequency x count + presence x (count > 0)`` over output tokens,
and CTRL's repetition penalty (transformers' ``RepetitionPenaltyLogitsProcessor``) over prompt and
output tokens, applied first: ``logit / r`` where positive, ``logit x r`` where not.
"""

from __future__ import annotations

import torch

PRESENCE, FREQUENCY, REPETITION = range(3)  # columns of penalty_params


class PenaltyState:
    """Token counts per slot, ``[slots, V]`` int32 each (output and prompt), allocated on first use."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.slots, self.vocab, self.device = slots, vocab, device
        self.output: torch.Tensor | None = None
        self.prompt: torch.Tensor | None = None

    def _ready(self) -> None:
        if self.output is None:
            z = {"dtype": torch.int32, "device": self.device}
            self.output = torch.zeros(self.slots, self.vocab, **z)
            self.prompt = torch.zeros(self.slots, self.vocab, **z)

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the counts of ``slots`` [R] (requests starting their first chunk)."""
        self._ready()
        self.output.index_fill_(0, slots, 0)
        self.prompt.index_fill_(0, slots, 0)

    def count(self, tokens: torch.Tensor, codes: torch.Tensor) -> None:
        """Count ``tokens`` [N] into their slots: ``codes`` [N] are ``slot * 2 + is_output``."""
        self._ready()
        slot, is_output = codes >> 1, (codes & 1).to(torch.int32)
        offsets = slot * self.vocab + tokens.to(torch.int64)
        self.output.view(-1).index_add_(0, offsets, is_output)
        self.prompt.view(-1).index_add_(0, offsets, 1 - is_output)

    def count_sampled(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Each sampled token [R] of a penalized row, into its slot's output counts."""
        self._ready()
        offsets = slots * self.vocab + tokens.to(torch.int64)
        self.output.view(-1).index_add_(0, offsets, torch.ones_like(offsets, dtype=torch.int32))

    def apply(self, logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
              params: torch.Tensor) -> None:
        """Penalize ``logits`` [B, V] float32 in place at ``rows`` [R], whose counts are in ``slots``
        [R] and settings in ``params`` [R, 3] (presence, frequency, repetition)."""
        self._ready()
        x = logits.index_select(0, rows)
        out = self.output.index_select(0, slots)
        seen = (out + self.prompt.index_select(0, slots)) > 0
        rep = params[:, REPETITION, None]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - params[:, FREQUENCY, None] * out - params[:, PRESENCE, None] * (out > 0)
        logits.index_copy_(0, rows, x)


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                     values: torch.Tensor) -> None:
    """``logits[rows[i], ids[i]] += values[i]`` (OpenAI's logit_bias), in place."""
    vocab = logits.shape[1]
    logits.view(-1).index_add_(0, rows * vocab + ids, values)

"""One launch as the scheduler planned it: host-side arrays in the launch shape, and what each
row will compute, so the next launch can be planned before this one's ids are read. Frozen once
scheduled: what batch I/O learns while writing it goes into the launch's ``OutputPlan``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fusedserve.coordinator.engine.sequence import Sequence


@dataclass(frozen=True)
class PromptSpan:
    """A row's prompt-logprob tokens: ``count`` of them from ``offset`` in the launch's list,
    the first at prompt position ``first`` (its logprob is that of token ``first + 1``)."""

    row: int
    offset: int
    count: int
    first: int


@dataclass(frozen=True)
class ScheduledBatch:
    """Rows are ``seqs`` in order: ``num_decode`` decode rows (one token each), then prompt
    chunks. Token arrays are packed row after row ([T]); row arrays are [B]."""

    seqs: tuple[Sequence, ...]
    num_decode: int
    query_lens: tuple[int, ...]  # new tokens per row
    token_ids: np.ndarray  # int32 [T]
    positions: np.ndarray  # int32 [T]
    slot_mapping: np.ndarray  # int64 [T]
    seq_lens: np.ndarray  # int32 [B]: each row's context after the launch
    block_tables: np.ndarray  # int32 [B, W]
    # The row of the launch in flight whose sampled id is this decode row's input (its token is
    # not read yet), or -1 where ``token_ids`` holds it.
    feed_rows: np.ndarray  # int32 [B]
    samples: tuple[bool, ...]  # the row samples a token
    computed_to: tuple[int, ...]  # the row's K/V reach after this launch
    draw_steps: tuple[int, ...]  # the sampled token's index in the output
    # Speculating requests as (first row, rows): consecutive decode rows, the request's newest token
    # then one row per proposal. The first row stands for the request; the others follow it.
    spec_groups: tuple[tuple[int, int], ...] = ()
    # A draft model on the device proposes (and must see every launch's tokens): the proposal rows'
    # token ids are placeholders it fills.
    device_proposals: bool = False

    def follows(self, row: int) -> bool:
        """The row carries a proposal of a speculating request whose first row is earlier."""
        return any(first < row < first + n for first, n in self.spec_groups)

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def query_start_loc(self) -> np.ndarray:
        """int32 [B + 1]: row r's tokens are ``[qsl[r], qsl[r + 1])``."""
        return np.concatenate([[0], np.cumsum(self.query_lens)]).astype(np.int32)

    def chunk_start(self, row: int) -> int:
        """The position of the row's first new token."""
        return int(self.seq_lens[row]) - self.query_lens[row]

"""One launch as the device sees it: vLLM V1's phase-less batch.

B rows (sequences), T packed tokens. The first ``num_decode`` rows have one token each (a
running sequence's newest token); the rows after them are prompt chunks of any length.
A row's context after the launch (``seq_lens``) includes what it had in the pages
before (a cached prefix, earlier chunks, its output so far) and its new tokens. The same
shape carries a decode step, a prefill, a chunked prefill riding with decodes, or any mix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    token_ids: torch.Tensor  # [T] int32
    positions: torch.Tensor  # [T] int32
    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V is written
    query_start_loc: torch.Tensor  # [B + 1] int32: row r's tokens are [qsl[r], qsl[r + 1])
    seq_lens: torch.Tensor  # [B] int32: each row's context after this launch
    block_tables: torch.Tensor  # [B, W] int32
    num_decode: int  # leading rows of one token each
    # Host copies for the prompt chunks (rows num_decode..B-1), so planning their attention
    # reads nothing back from the device: new tokens, and context after this launch.
    prompt_query_lens: list[int] = field(default_factory=list)
    prompt_seq_lens: list[int] = field(default_factory=list)
    # A hybrid model's rows: each row's recurrent-state slot [B] int64, and the slots this launch
    # starts from zero (their first chunk is in it) [R] int64 (kernels/hybrid_cache.py).
    state_slots: torch.Tensor | None = None
    state_resets: torch.Tensor | None = None
    # Snapshots (prefix caching): (snapshot, slot) restored before the layers, (slot, snapshot)
    # saved after them, [n, 2] int64 each.
    state_restores: torch.Tensor | None = None
    state_saves: torch.Tensor | None = None
    # Speculating requests' decode rows, (first row, rows) each: a hybrid runs them in order, one
    # state per position, and keeps the accepted one after verification.
    spec_groups: list[list[int]] = field(default_factory=list)
    # LoRA: each token's adapter slot [T] int64 (-1: the base model alone); None: no adapters.
    lora_slots: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_only(self) -> bool:
        return self.num_decode == self.num_rows == self.num_tokens

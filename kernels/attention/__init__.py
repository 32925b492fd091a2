"""Attention over the paged KV cache: the interface each backend's attention implements
(``kernels/backend_table.py``), and ``prompt_rows``, the prompt-chunk path native and ATen share.

A backend is built per workspace (it may own scratch) and serves one launch in two calls:
``begin(batch, block_size)`` once, then ``attend(q, k_cache, v_cache, out)`` per layer,
after the layer wrote this launch's K/V into the pages. The launch's first
``num_decode`` rows have one query token each and read their context from the pages;
the rows after them are prompt chunks, causal within the chunk and after whatever their
sequence has in the pages already (a cached prefix, or earlier chunks).
"""

from __future__ import annotations

from typing import Protocol

import torch

from fusedserve.kernels.forward_batch import ForwardBatch


class AttentionBackend(Protocol):
    def begin(self, batch: ForwardBatch, block_size: int) -> None: ...

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               out: torch.Tensor) -> None: ...

"""What a launch hands back to the host: exactly the rows each request needs.

Greedy rows carry an id, top-K rows their candidates, full-logits rows their logits
row; nothing else crossed to the host. Reading a row that has none of these is a
bug upstream, so it raises naming the request and the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class MissingRowError(RuntimeError):
    """A result row has neither sampled ids, candidates nor logits."""


@dataclass
class DecodeResult:
    """Host view of one launch's outputs for B rows.

    ``topk_rows``/``full_rows`` list which batch rows the compact ``topk_*`` and
    ``logits`` arrays hold, in order.
    """

    step: int
    sampled_ids: np.ndarray | None  # [B] int32
    topk_values: np.ndarray | None = None  # [n_topk, K] float32
    topk_ids: np.ndarray | None = None  # [n_topk, K] int32
    topk_rows: list[int] = field(default_factory=list)
    logits: np.ndarray | None = None  # [n_full, vocab] float32
    full_rows: list[int] = field(default_factory=list)
    # Device sampling: rows that asked for logprobs, the sampled token's, and the top n.
    logprob_rows: list[int] = field(default_factory=list)
    sampled_logprobs: np.ndarray | None = None  # [n_logprob] float32
    top_logprob_ids: np.ndarray | None = None  # [n_logprob, n] int32
    top_logprob_values: np.ndarray | None = None  # [n_logprob, n] float32

    def device_logprobs(self, row: int, request_id: str, n: int) -> tuple[float, list[tuple[int, float]]]:
        """The sampled token's logprob and the ``n`` most likely tokens', computed on the device."""
        if row not in self.logprob_rows or self.sampled_logprobs is None:
            raise MissingRowError(f"request {request_id!r}, step {self.step}: row {row} has no logprobs")
        j = self.logprob_rows.index(row)
        top = []
        if n and self.top_logprob_ids is not None and self.top_logprob_values is not None:
            ids, values = self.top_logprob_ids[j, :n], self.top_logprob_values[j, :n]
            top = [(int(i), float(v)) for i, v in zip(ids, values)]
        return float(self.sampled_logprobs[j]), top

    def candidates(self, row: int, request_id: str) -> tuple[np.ndarray, np.ndarray]:
        """(values, ids) to sample row ``row`` from: its top-K or its full logits."""
        if row in self.full_rows and self.logits is not None:
            values = self.logits[self.full_rows.index(row)]
            return values, np.arange(values.shape[0])
        if row in self.topk_rows and self.topk_values is not None and self.topk_ids is not None:
            j = self.topk_rows.index(row)
            return self.topk_values[j], self.topk_ids[j]
        raise MissingRowError(
            f"request {request_id!r}, step {self.step}: row {row} has no candidates or logits "
            "(its sampling kind was not requested from the device)"
        )

    def greedy_id(self, row: int, request_id: str) -> int:
        if self.sampled_ids is None or row >= len(self.sampled_ids):
            raise MissingRowError(
                f"request {request_id!r}, step {self.step}: row {row} has no sampled id"
            )
        return int(self.sampled_ids[row])

    def full_logits(self, row: int, request_id: str) -> np.ndarray:
        if row in self.full_rows and self.logits is not None:
            return self.logits[self.full_rows.index(row)]
        raise MissingRowError(
            f"request {request_id!r}, step {self.step}: row {row} has no logits (not a full row)"
        )

"""What a launch hands back to the host: each row's sampled id, and the logprobs asked for.

Reading something a row did not ask for (logprobs of a row that wanted none) is a bug
upstream, so it raises naming the request and the step; the scheduler fails that row alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fusedserve.coordinator.engine.scheduled_batch import PromptSpan
from fusedserve.coordinator.engine.sequence import Sequence
from fusedserve.coordinator.errors import RequestError


class MissingRowError(RuntimeError):
    """A row's output is not in the launch's results."""


def _empty(*shape: int, dtype=np.float32) -> np.ndarray:
    return np.zeros(shape, dtype=dtype)


@dataclass
class StepOutputs:
    """Host view of one launch's outputs for B rows (numpy views of its arena bank)."""

    step: int
    sampled_ids: np.ndarray  # [B] int32
    # Speculating requests' first rows, and the tokens each gained (1 + accepted proposals): its
    # tokens are the ids of that many rows from its first.
    spec_firsts: list[int] = field(default_factory=list)
    spec_accepted: np.ndarray = field(default_factory=lambda: _empty(0, dtype=np.int32))  # [S]
    # Rows that asked for logprobs, the sampled token's, and the top n.
    logprob_rows: list[int] = field(default_factory=list)
    sampled_logprobs: np.ndarray = field(default_factory=lambda: _empty(0))  # [NL]
    top_logprob_ids: np.ndarray = field(default_factory=lambda: _empty(0, 0, dtype=np.int32))  # [NL, N]
    top_logprob_values: np.ndarray = field(default_factory=lambda: _empty(0, 0))
    prompt_spans: list[PromptSpan] = field(default_factory=list)
    prompt_logprobs: np.ndarray = field(default_factory=lambda: _empty(0))  # [TL]
    prompt_top_ids: np.ndarray = field(default_factory=lambda: _empty(0, 0, dtype=np.int32))  # [TL, NP]
    prompt_top_values: np.ndarray = field(default_factory=lambda: _empty(0, 0))
    # Rows whose settings never reached the device, each with the error that fails its request.
    invalid: dict[int, RequestError] = field(default_factory=dict)
    # A pooling runner's rows whose prompts ended in the launch, and what each pooled [PL, H].
    pool_rows: list[int] = field(default_factory=list)
    pooled: np.ndarray = field(default_factory=lambda: _empty(0, 0))

    def pooled_row(self, row: int, request_id: str) -> np.ndarray:
        """A copy of the row's pooled floats (the bank is rewritten two launches later)."""
        if row in self.invalid:
            err = self.invalid[row]
            raise RequestError(err.code, f"request {request_id!r}, step {self.step}: {err}")
        if row not in self.pool_rows:
            raise MissingRowError(f"request {request_id!r}, step {self.step}: row {row} has no pooled output")
        return self.pooled[self.pool_rows.index(row)].copy()

    def token(self, row: int, request_id: str) -> int:
        if row in self.invalid:
            err = self.invalid[row]
            raise RequestError(err.code, f"request {request_id!r}, step {self.step}: {err}")
        if row >= len(self.sampled_ids):
            raise MissingRowError(f"request {request_id!r}, step {self.step}: row {row} has no sampled id")
        return int(self.sampled_ids[row])

    def gained(self, row: int) -> int:
        """How many tokens the request of first row ``row`` gained: 1 unless it speculated."""
        if row not in self.spec_firsts:
            return 1
        n = int(self.spec_accepted[self.spec_firsts.index(row)])
        if n < 1:
            raise MissingRowError(f"step {self.step}: speculating row {row} gained {n} tokens")
        return n

    def accepted(self) -> dict[int, int]:
        """Tokens gained by each speculating request, by its first row."""
        return {row: int(n) for row, n in zip(self.spec_firsts, self.spec_accepted)}

    def logprobs(self, row: int, request_id: str, n: int) -> tuple[float, list[tuple[int, float]]]:
        """The sampled token's logprob and the ``n`` most likely tokens', computed on the device."""
        if row not in self.logprob_rows:
            raise MissingRowError(f"request {request_id!r}, step {self.step}: row {row} has no logprobs")
        j = self.logprob_rows.index(row)
        ids, values = self.top_logprob_ids[j, :n], self.top_logprob_values[j, :n]
        return float(self.sampled_logprobs[j]), [(int(i), float(v)) for i, v in zip(ids, values)]

    def record_prompt_logprobs(self, row: int, seq: Sequence) -> None:
        """Store the row's prompt logprobs (if it asked) on the sequence, by position."""
        for span in self.prompt_spans:
            if span.row != row:
                continue
            n = seq.params.prompt_logprobs or 0
            if not seq.prompt_logprobs:
                seq.prompt_logprobs = [None] * len(seq.prompt_ids)
                seq.prompt_top_logprobs = [[] for _ in seq.prompt_ids]
            for k in range(span.count):
                j, pos = span.offset + k, span.first + k + 1
                seq.prompt_logprobs[pos] = float(self.prompt_logprobs[j])
                top = zip(self.prompt_top_ids[j, :n], self.prompt_top_values[j, :n])
                seq.prompt_top_logprobs[pos] = [(int(i), float(v)) for i, v in top]

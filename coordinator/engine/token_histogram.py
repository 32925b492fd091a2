"""A cumulative histogram kept as plain counts, so a worker's stats can carry it to the gateway,
which exports it as a Prometheus histogram (``vllm:iteration_tokens_total``'s buckets)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# vLLM's buckets for tokens per engine step.
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class TokenHistogram:
    bounds: tuple[int, ...] = ITERATION_TOKEN_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bound, then +Inf; not cumulative
    total: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: int) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def to_dict(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total}

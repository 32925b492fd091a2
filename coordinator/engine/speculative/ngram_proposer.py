"""Prompt lookup: propose the tokens that followed the latest earlier occurrence of the request's
trailing n-gram (vLLM's ``ngram`` method, llama.cpp's ``llama-lookup``).

Agent and coding traffic repeats long spans of its context: a tool call quotes the prompt, an edit
copies the file it edits. When the last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``) occurred before, the tokens after that occurrence are likely next. A numpy
scan of the request's own tokens: O(context x n) per step, no index kept between steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramProposer:
    max_n: int = 4
    min_n: int = 2
    on_device: bool = False  # the proposals are made here, on the host

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` proposals to follow ``token_ids``, or none when no suffix recurs."""
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        ids = np.asarray(token_ids, dtype=np.int64)
        head = ids[:-1]  # an occurrence must have a token after it
        for n in range(min(self.max_n, len(ids) - 1), self.min_n - 1, -1):
            windows = sliding_window_view(head, n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return ids[start : start + k].tolist()
        return []

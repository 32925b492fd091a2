"""What a request's own settings allow and forbid, put into the launch's token bitmask: its
``allowed_token_ids``, its ``bad_words`` (as token sequences) and its ``min_tokens``.

Applied on the host to the row's mask words (the grammar's, or all ones), so the device sees one
mask whatever made it. A multi-token bad word needs the row's newest tokens to know whether its
last token is banned now, so such a row, like a grammar's, never runs a launch ahead.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fusedserve.shared_memory.slots import bitmask_words


def _words(token_ids: list[int], vocab: int) -> np.ndarray:
    words = np.zeros(bitmask_words(vocab), dtype=np.uint32)
    for t in set(token_ids):
        words[t >> 5] |= np.uint32(1 << (t & 31))
    return words


@dataclass(frozen=True)
class TokenRules:
    allowed: np.ndarray | None  # uint32 words of the allowed_token_ids, or None: all
    min_tokens: int
    end_ids: tuple[int, ...]  # refused while fewer than min_tokens tokens were generated
    bad_words: tuple[tuple[int, ...], ...]  # each as token ids

    @classmethod
    def build(cls, allowed: list[int] | None, min_tokens: int, end_ids: list[int],
              bad_words: list[list[int]], vocab: int) -> TokenRules | None:
        if allowed is None and not min_tokens and not bad_words:
            return None
        return cls(None if allowed is None else _words(allowed, vocab), min_tokens,
                   tuple(end_ids) if min_tokens else (), tuple(tuple(w) for w in bad_words if w))

    @property
    def needs_last_token(self) -> bool:
        return any(len(w) > 1 for w in self.bad_words)

    def applies(self, step: int) -> bool:
        """Whether the row's mask is needed when it samples output token ``step``."""
        return self.allowed is not None or bool(self.bad_words) or step < self.min_tokens

    def apply(self, words: np.ndarray, output_ids: list[int], step: int) -> None:
        """Narrow one row's mask ``words`` (uint32 view) for sampling output token ``step``."""
        if self.allowed is not None:
            words &= self.allowed
        banned = list(self.end_ids) if step < self.min_tokens else []
        for w in self.bad_words:
            if len(w) == 1 or (len(output_ids) >= len(w) - 1 and tuple(output_ids[1 - len(w):]) == w[:-1]):
                banned.append(w[-1])
        for t in banned:
            words[t >> 5] &= ~np.uint32(1 << (t & 31))

"""One request's structured-output state: its llguidance matcher and Qwen3's thinking gate.

The coordinator fills the row's token bitmask before a launch and advances the matcher with
the token the launch sampled. A row under a grammar is therefore never scheduled one launch
ahead (its mask needs the previous token). Thinking comes first and is free but for the end
tokens (an output that stopped while thinking would never reach its constrained part): with
the gate "open" tokens pass until ``</think>``; with "may" the first token may also be
``<think>``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # llguidance loads with the first grammar: a run without one never needs it
    import llguidance

FREE, MAY_THINK, THINKING = "free", "may_think", "thinking"


class GrammarState:
    def __init__(self, matcher: llguidance.LLMatcher, thinking: str, think_open: np.ndarray,
                 think_end: bytes, token_bytes: Callable[[int], bytes], ends: np.ndarray,
                 executor: llguidance.LLExecutor | None = None):
        self.matcher = matcher
        self.phase = {"none": FREE, "may": MAY_THINK, "open": THINKING}[thinking]
        self._think_open = think_open
        self._think_end = think_end
        self._token_bytes = token_bytes
        self._tail = b""  # the thought's last bytes: where its end marker may be
        self._ends = ends  # token ids that end the output: refused while thinking
        self.executor = executor  # fills many rows' masks at once, on its own threads

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (int32 words, bit v allows v)."""
        if self.phase != THINKING:
            import llguidance.numpy as llnp

            llnp.fill_next_token_bitmask(self.matcher, bitmask, row)
        self.adjust(bitmask, row)

    def adjust(self, bitmask: np.ndarray, row: int) -> None:
        """The thinking gate's part of the row's mask, over the grammar's (when it applies)."""
        words = bitmask.view(np.uint32)
        if self.phase == THINKING:
            bitmask[row] = -1
            for t in self._ends:
                words[row, t >> 5] &= ~np.uint32(1 << (t & 31))
        elif self.phase == MAY_THINK:
            for t in self._think_open:
                words[row, t >> 5] |= np.uint32(1 << (t & 31))

    def accept(self, token: int) -> None:
        """Advance by the sampled token; raises ValueError if the grammar refuses it."""
        if self.phase == MAY_THINK and token in self._think_open:
            self.phase, self._tail = THINKING, b""
            return
        if self.phase == THINKING:
            self._tail = (self._tail + self._token_bytes(token))[-4 * len(self._think_end):]
            if self._think_end in self._tail:
                self.phase = FREE
            return
        self.phase = FREE
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} breaks the grammar: {self.matcher.get_error()}")

    @property
    def speculable(self) -> bool:
        """Proposals can be checked against the grammar (not in a thinking phase, whose gate is the
        coordinator's, not the matcher's)."""
        return self.phase == FREE

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar accepts from here (state unchanged)."""
        return int(self.matcher.validate_tokens(tokens))

    def fill_proposals(self, bitmask: np.ndarray, row: int, proposals: list[int]) -> None:
        """A speculating row's masks: ``row`` as ``fill``, then row ``row + j`` after the first j
        proposals (each allowed, ``allowed_prefix``); the matcher ends where it started."""
        import llguidance.numpy as llnp

        llnp.fill_next_token_bitmask(self.matcher, bitmask, row)
        for j, token in enumerate(proposals, 1):
            if not self.matcher.consume_token(token):
                raise ValueError(f"proposal {token} breaks the grammar: {self.matcher.get_error()}")
            llnp.fill_next_token_bitmask(self.matcher, bitmask, row + j)
        self.matcher.rollback(len(proposals))

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the output ends here)."""
        return self.phase == FREE and self.matcher.is_stopped()


def fill_rows(rows: list[tuple[GrammarState, int]], bitmask: np.ndarray) -> None:
    """Every listed row's mask: the grammars' all at once on llguidance's threads (one call,
    not one per row), then each row's thinking gate."""
    import llguidance.numpy as llnp

    grammar = [(s.matcher, r) for s, r in rows if s.phase != THINKING]
    executor = rows[0][0].executor if rows else None
    if executor is not None and len(grammar) > 1:
        llnp.fill_next_token_bitmask_par(executor, grammar, bitmask)
    else:
        for matcher, r in grammar:
            llnp.fill_next_token_bitmask(matcher, bitmask, r)
    for s, r in rows:
        s.adjust(bitmask, r)

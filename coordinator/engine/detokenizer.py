"""One sequence's output text, built a token at a time, and its stop strings.

Each step costs O(new tokens): the tokenizer's stream decodes only the new token,
the stop strings are searched only where they could newly end, and the streamed
delta holds back a tail that might still become a stop string, so a stop string
never reaches a client, even when it spans two tokens.
"""

from __future__ import annotations

from kernels.model.tokenizer import TextTokenizer


class Detokenizer:
    def __init__(self, tokenizer: TextTokenizer, stop: list[str]):
        self._stream = tokenizer.stream()
        self._stop = list(stop)
        self._longest = max((len(s) for s in stop), default=0)
        self.text = ""  # the output so far, cut before a stop string once one appears
        self.stopped = False  # a stop string appeared
        self._sent = 0  # characters of ``text`` handed out as deltas

    def push(self, token: int) -> None:
        """Append one sampled token's text (none yet if it ends mid-character)."""
        if not self.stopped:
            self._append(self._stream.push(token))

    def finish(self) -> None:
        """The sequence ended: flush what the decoder held (an unfinished character)."""
        if not self.stopped:
            self._append(self._stream.flush())

    def _append(self, piece: str) -> None:
        if not piece:
            return
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        cuts = [i for i in (self.text.find(s, start) for s in self._stop) if i >= 0]
        if cuts:
            self.text = self.text[: min(cuts)]
            self.stopped = True

    def delta(self, final: bool) -> str:
        """Text not yet handed out; unless ``final``, less a tail that may start a stop string."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._held_back()
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best

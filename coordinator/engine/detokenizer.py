"""One sequence's output text, built a token at a time, and its stop strings.

Each step costs O(new characters): the tokenizer's stream decodes only the new token, the
stop strings are one automaton walked over the new characters alone (``stop_strings.py``),
and the streamed delta holds back the tail the automaton says may still become a stop
string, so a stop string never reaches a client, even when it spans two tokens.
"""

from __future__ import annotations

from fusedserve.coordinator.engine.stop_strings import StopMatcher
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer


class Detokenizer:
    def __init__(self, tokenizer: TextTokenizer, stop: list[str], include_stop: bool = False):
        """``include_stop``: the text ends after the stop string that ended it (vLLM's
        ``include_stop_str_in_output``), not before it."""
        self._stream = tokenizer.stream()
        self._stops = StopMatcher(stop)
        self._include_stop = include_stop
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
        found = self._stops.feed(piece)
        if found is None:
            self.text += piece
        else:
            cut = found[1] if self._include_stop else found[0]
            self.text = (self.text + piece)[: len(self.text) + cut]
            self.stopped = True

    def delta(self, final: bool) -> str:
        """Text not yet handed out; unless ``final``, less a tail that may start a stop string."""
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._stops.held
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out

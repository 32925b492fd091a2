"""Qwen3's reasoning split: ``<think>...</think>`` goes to ``reasoning_content``, the rest to
``content``, streamed or not, with the same result either way.

The prompt decides where the output starts: a prompt that opened a think block (Qwen3's
thinking-only models put ``<think>`` in it) starts in reasoning; otherwise the output is
content unless it opens with ``<think>``. An output with no think block is all content
(``enable_thinking=false``), and an unclosed one is all reasoning (cut by ``max_tokens``).
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def _prefix_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningStream:
    """Text deltas in, (reasoning delta, content delta) out; a marker split across deltas is held
    back until it is whole."""

    def __init__(self, opened: bool):
        self.mode = "reasoning" if opened else "start"
        self.saw_block = opened  # the output has a think block (else reasoning is None)
        self._buf = ""
        self._strip = False  # drop the newlines that follow </think>

    def push(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        reasoning = content = ""
        if self.mode == "start":
            head = self._buf.lstrip()
            if head.startswith(START):
                self.mode, self._buf, self.saw_block = "reasoning", head[len(START):], True
            elif START.startswith(head):
                return "", ""  # may still become <think>
            else:
                self.mode = "content"
        if self.mode == "reasoning":
            i = self._buf.find(END)
            if i < 0:
                keep = _prefix_tail(self._buf, END)
                reasoning, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf = self._buf[:i], self._buf[i + len(END):]
            self.mode, self._strip = "content", True
        if self.mode == "content":
            content, self._buf = self._buf, ""
            if self._strip:
                content = content.lstrip("\n")
                self._strip = not content
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The output ended: what was held back (an unfinished marker is text)."""
        rest, self._buf = self._buf, ""
        if self.mode == "reasoning":
            return rest, ""
        return "", rest.lstrip("\n") if self._strip else rest


def split(text: str, opened: bool) -> tuple[str | None, str]:
    """(reasoning or None when there was no think block, content) of a whole output."""
    stream = ReasoningStream(opened)
    r1, c1 = stream.push(text)
    r2, c2 = stream.finish()
    return (r1 + r2 if stream.saw_block else None), c1 + c2

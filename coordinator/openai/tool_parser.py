"""Qwen3's (Hermes-style) tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
in the content (never in reasoning: the reasoning split runs first) -> OpenAI ``tool_calls``.

A call is emitted once its closing tag arrives, whole: the name first, then its arguments,
which concatenate to valid JSON. A call whose body is not such JSON stays content, as does
one the output never closed, so a malformed call never fails a request.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from fusedserve.coordinator.openai.reasoning_parser import _prefix_tail

START, END = "<tool_call>", "</tool_call>"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def parse_call(body: str) -> ToolCall | None:
    """One call's JSON body, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolStream:
    """Content deltas in, (content delta, finished calls) out; ``parse`` reads one call's body
    (Hermes JSON here, Qwen's XML in ``xml_tool_parser``)."""

    def __init__(self, parse: Callable[[str], ToolCall | None] = parse_call) -> None:
        self.parse = parse
        self._buf = ""
        self._in_call = False
        self._ws = ""  # whitespace between calls, emitted only if more text follows
        self.calls: list[ToolCall] = []

    def _text(self, piece: str) -> str:
        if not piece:
            return ""
        if not piece.strip():
            self._ws += piece
            return ""
        out, self._ws = self._ws + piece, ""
        return out

    def push(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        content, calls = "", []
        while True:
            if not self._in_call:
                i = self._buf.find(START)
                if i < 0:
                    keep = _prefix_tail(self._buf, START)
                    content += self._text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return content, calls
                content += self._text(self._buf[:i])
                self._buf, self._in_call = self._buf[i + len(START):], True
            j = self._buf.find(END)
            if j < 0:
                return content, calls
            body, self._buf, self._in_call = self._buf[:j], self._buf[j + len(END):], False
            call = self.parse(body)
            if call is None:
                content += self._text(START + body + END)
            else:
                calls.append(call)
                self.calls.append(call)
                self._ws = ""

    def finish(self) -> str:
        """The output ended: an unclosed call and held-back text are content."""
        rest = (START if self._in_call else "") + self._buf
        self._buf, self._in_call = "", False
        out = self._text(rest)
        if not out and self._ws and not self.calls:
            out, self._ws = self._ws, ""
        return out


def extract(text: str, parse: Callable[[str], ToolCall | None] = parse_call
            ) -> tuple[str | None, list[ToolCall]]:
    """(content or None when only calls remain, calls) of a whole content."""
    stream = ToolStream(parse)
    content, calls = stream.push(text)
    content += stream.finish()
    if calls and not content.strip():
        return None, calls
    return content, calls

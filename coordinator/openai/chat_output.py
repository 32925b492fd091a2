"""One chat choice's output -> OpenAI's message (whole) or deltas (streamed): the reasoning
split, then tool calls, Hermes JSON or Qwen's XML (free in ``auto`` mode, held to the functions' schemas when
forced). Streamed and whole outputs go through the same parsers, so they always agree."""

from __future__ import annotations

from fusedserve.coordinator.openai import reasoning_parser, tool_parser
from fusedserve.coordinator.openai.tool_choice import ToolPlan
from fusedserve.coordinator.openai.tool_parser import ToolCall, ToolStream


def message(text: str, finish_reason: str, reasoning: bool, opened: bool,
            tools: ToolPlan) -> tuple[dict, str]:
    """(message, finish_reason) of a whole output."""
    thought, content = reasoning_parser.split(text, opened) if reasoning else (None, text)
    msg: dict = {"role": "assistant", "content": content}
    if thought is not None:
        msg["reasoning_content"] = msg["reasoning"] = thought
    if tools.parsed:
        msg["content"], calls = tool_parser.extract(content, tools.parser())
        if calls:
            msg["tool_calls"] = [c.to_openai() for c in calls]
            return msg, "tool_calls"
    return msg, finish_reason


def _call_deltas(k: int, call: ToolCall) -> list[dict]:
    """OpenAI's order: the call's id and name (empty arguments), then its arguments."""
    head = {"index": k, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [{"tool_calls": [head]}, {"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]}]


class ChatStream:
    """Text deltas of one choice in, lists of OpenAI ``delta`` objects out."""

    def __init__(self, reasoning: bool, opened: bool, tools: ToolPlan):
        self.reasoning = reasoning_parser.ReasoningStream(opened) if reasoning else None
        self.tools = ToolStream(tools.parser()) if tools.parsed else None
        self.calls = 0

    def push(self, text: str) -> list[dict]:
        thought, content = self.reasoning.push(text) if self.reasoning else ("", text)
        return self._deltas(thought, content)

    def finish(self, finish_reason: str) -> tuple[list[dict], str]:
        """The rest of the output's deltas and the choice's finish reason."""
        thought, content = self.reasoning.finish() if self.reasoning else ("", "")
        deltas = self._deltas(thought, content)
        if self.tools is not None:
            rest = self.tools.finish()
            if rest:
                deltas.append({"content": rest})
        return deltas, "tool_calls" if self.calls else finish_reason

    def _deltas(self, thought: str, content: str) -> list[dict]:
        out: list[dict] = []
        if thought:
            out.append({"reasoning_content": thought, "reasoning": thought})
        if not content:
            return out
        if self.tools is None:
            out.append({"content": content})
            return out
        text, calls = self.tools.push(content)
        if text:
            out.append({"content": text})
        for call in calls:
            out.extend(_call_deltas(self.calls, call))
            self.calls += 1
        return out

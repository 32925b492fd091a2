"""Qwen's XML tool calls (vLLM's qwen3_coder parser): parameters typed by the tool's schema,
several calls per turn, malformed ones left as content, and a stream split anywhere reading the
same calls as the whole text."""

from __future__ import annotations

import json

import pytest

from fusedserve.coordinator.openai import tool_parser
from fusedserve.coordinator.openai.gateway import call_format
from fusedserve.coordinator.openai.tool_choice import ToolPlan, plan
from fusedserve.coordinator.openai.tool_parser import ToolStream

TOOLS = [
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"},
                                         "filters": {"type": "object"}, "exact": {"type": "boolean"},
                                         "tags": {"type": "array", "items": {"type": "string"}}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}},
]
OUTPUT = (
    "I will look that up.\n"
    "<tool_call>\n<function=search>\n<parameter=query>\nbest \"pizza\" {in} Napoli\n</parameter>\n"
    "<parameter=limit>\n5\n</parameter>\n<parameter=filters>\n{\"open\": true, \"price\": [1, 2]}\n"
    "</parameter>\n<parameter=exact>\nfalse\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
    "</function>\n</tool_call>\n"
    "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/x.py\n</parameter>\n<parameter=content>\n"
    "def f():\n    return 42\n\n</parameter>\n</function>\n</tool_call>"
)
WANT = [("search", {"query": 'best "pizza" {in} Napoli', "limit": 5,
                    "filters": {"open": True, "price": [1, 2]}, "exact": False, "tags": ["a", "b"]}),
        ("write_file", {"path": "/tmp/x.py", "content": "def f():\n    return 42\n"})]


def _plan() -> ToolPlan:
    return ToolPlan("auto", TOOLS, format="qwen3_coder")


def test_calls_are_typed_by_the_tools_schemas():
    content, calls = tool_parser.extract(OUTPUT, _plan().parser())
    assert content == "I will look that up.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == WANT


def test_a_stream_split_at_every_character_reads_the_same_calls():
    want_content, want = tool_parser.extract(OUTPUT, _plan().parser())
    stream = ToolStream(_plan().parser())
    content, calls = "", []
    for ch in OUTPUT:
        text, new = stream.push(ch)
        content += text
        calls += new
    content += stream.finish()
    assert content.strip() == want_content.strip()  # whitespace before a call is held back, not lost text
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want]


@pytest.mark.parametrize("body", [
    "<tool_call>\n<function=search>\nstray text\n</function>\n</tool_call>",  # text outside parameters
    "<tool_call>\n{\"name\": \"search\", \"arguments\": {}}\n</tool_call>",  # Hermes JSON, not XML
    "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n",  # never closed
])
def test_what_is_not_a_whole_xml_call_stays_content(body):
    content, calls = tool_parser.extract(body, _plan().parser())
    assert calls == [] and content == body


def test_the_format_follows_the_flag_or_the_chat_template():
    coder = "{% for tool in tools %}<function={{ tool.name }}>...{% endfor %}<tool_call>"
    assert call_format("auto", coder) == "qwen3_coder"
    assert call_format("auto", "<tool_call>{{ tool_call.name }}") == "hermes"
    assert call_format("auto", "plain") is None and call_format("none", coder) is None
    assert call_format("qwen3_xml", "") == call_format("qwen3_coder", "") == "qwen3_coder"
    assert call_format("hermes", coder) == "hermes"


def test_forced_calls_are_held_to_the_xml_format():
    body = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "write_file"}}}
    named = plan(body, True, call_format="qwen3_coder")
    assert named.format == "qwen3_coder" and '"<function=write_file>"' in named.grammar
    assert "<function=search>" not in named.grammar
    required = plan({**body, "tool_choice": "required"}, True, call_format="qwen3_coder")
    assert '"<function=search>"' in required.grammar and "%json" in required.grammar  # typed values
    assert '"name"' not in required.grammar  # no Hermes JSON object

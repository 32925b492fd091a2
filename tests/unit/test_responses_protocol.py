"""The Responses API's pure halves: a request as a chat body (input items, tools, text.format,
instructions), a chat message as output items and back, and the store's count and byte bounds."""

from __future__ import annotations

import pytest

from fusedserve.coordinator.openai import responses_protocol as rp
from fusedserve.coordinator.openai.api_error import ApiError
from fusedserve.coordinator.openai.responses_store import ResponseStore

OSLO, ROME = '{"city": "Oslo"}', '{"city": "Rome"}'
FN = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def test_input_items_become_chat_messages():
    chat, conversation, items = rp.chat_body({
        "instructions": "Be brief.", "max_output_tokens": 9, "tools": [FN],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather in "},
                                                {"type": "input_text", "text": "Oslo and Rome?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": OSLO},
                  {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": ROME},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                  {"type": "message", "role": "developer", "content": "Use Celsius."}]}, history=[])
    assert chat["messages"][0] == {"role": "system", "content": "Be brief."}
    assert conversation[0] == {"role": "user", "content": "Weather in Oslo and Rome?"}
    calls = conversation[1]["tool_calls"]  # two calls in a row: one assistant turn
    assert [c["id"] for c in calls] == ["c1", "c2"] and conversation[1]["role"] == "assistant"
    assert conversation[2] == {"role": "tool", "tool_call_id": "c1", "content": "sunny"}
    assert conversation[3] == {"role": "system", "content": "Use Celsius."}
    assert chat["max_tokens"] == 9 and chat["tools"][0]["function"]["name"] == "get_weather"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["response_format"]["json_schema"]["name"] == "x" and len(items) == 6


def test_history_comes_before_the_input_and_instructions_lead_only_this_turn():
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chat, conversation, _ = rp.chat_body({"input": "again", "instructions": "Short."}, history)
    assert [m["content"] for m in chat["messages"]] == ["Short.", "hi", "hello", "again"]
    assert [m["content"] for m in conversation] == ["hi", "hello", "again"]


@pytest.mark.parametrize("body", [
    {"input": []}, {"input": 3}, {"input": [{"role": "robot", "content": "x"}]},
    {"input": "x", "tools": [{"type": "file_search"}]}, {"input": "x", "tool_choice": {"type": "web"}},
    {"input": [{"type": "function_call_output", "call_id": "c"}]}, {"input": "x", "background": True},
    {"input": [{"type": "computer_call"}]}, {"input": "x", "instructions": 5},
])
def test_bad_requests_are_refused_by_field(body):
    with pytest.raises(ApiError) as err:
        rp.chat_body(body, [])
    assert err.value.status == 400 and err.value.param


def test_output_items_and_their_replay():
    msg = {"role": "assistant", "content": "", "reasoning_content": "think",
           "tool_calls": [{"id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": "{}"}}]}
    items = rp.output_items(msg)
    assert [i["type"] for i in items] == ["reasoning", "function_call"]
    assert items[1]["call_id"] == "call_1"
    replay = rp.assistant_messages(items)
    assert replay == [{"role": "assistant", "content": "", "tool_calls": msg["tool_calls"]}]
    text = rp.output_items({"role": "assistant", "content": "Hi."})
    assert rp.assistant_messages(text) == [{"role": "assistant", "content": "Hi."}]
    resp = rp.response_object("resp_1", {"max_output_tokens": 3}, "m", text, "completed",
                              {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
                              finish_reason="length")
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["usage"]["input_tokens"] == 4 and resp["usage"]["total_tokens"] == 7


def test_the_store_drops_the_oldest_past_either_bound():
    store = ResponseStore(max_count=2, max_bytes=10_000)
    for i in range(3):
        assert store.put({"id": f"r{i}"}, [{"role": "user", "content": "x"}], [])
    assert store.get("r0") is None and store.get("r2") is not None and len(store) == 2
    small = ResponseStore(max_count=100, max_bytes=300)
    for i in range(5):
        small.put({"id": f"r{i}"}, [{"role": "user", "content": "y" * 60}], [])
    assert small.nbytes <= 300 and small.get("r4") is not None and small.get("r0") is None
    assert not small.put({"id": "big"}, [{"role": "user", "content": "z" * 400}], [])  # alone too big
    assert small.delete("r4") and not small.delete("r4") and small.get("r4") is None
    assert not ResponseStore(0, 1000).put({"id": "r"}, [], [])

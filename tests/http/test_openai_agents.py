"""What Qwen3 agent clients send, through the official openai client against ``fusedserve
serve --http-port``, on a checkpoint that really thinks and calls tools (``agent_model``):
the reasoning split, Hermes tool calls (streamed the way OpenAI streams them), calls inside
a think block that are not calls, thinking off, and JSON constrained after the thinking."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.agent_model import TOOLS, write_agent_model
from tests.serve_proc import ServeProcess

# Bounded, so the grammar closes the object whatever text the tiny model would ramble on with
# (its float32 greedy path differs between the hosts' kernels).
CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                       "legs": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["name", "legs"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory):
    d = tmp_path_factory.mktemp("agent")
    model = write_agent_model(d / "model")
    srv = ServeProcess.start(d / "serve.log", "--model", str(model), "--workers", "1", "--dtype", "float32",
                             "--max-batch", "8", "--num-blocks", "128", "--http-port", "0",
                             "--enable-auto-tool-choice")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http}/v1", api_key="none", max_retries=0)


def _ask(oai, text: str, stream: bool = False, thinking: bool | None = None, **kw):
    extra = kw.pop("extra_body", {})
    if thinking is not None:
        extra["chat_template_kwargs"] = {"enable_thinking": thinking}
    return oai.chat.completions.create(model=oai.models.list().data[0].id, temperature=0,
                                       messages=[{"role": "user", "content": text}], stream=stream,
                                       max_tokens=kw.pop("max_tokens", 120), extra_body=extra, **kw)


def _collect(chunks) -> dict:
    """A streamed choice put back together: reasoning, content, tool calls by index, finish."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "order": []}
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        d = ch.delta
        out["reasoning"] += getattr(d, "reasoning_content", None) or ""
        out["content"] += d.content or ""
        for tc in d.tool_calls or []:
            call = out["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                call["id"] = tc.id
            if tc.function and tc.function.name:
                assert call["arguments"] == "", "the name comes before any argument"
                call["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
        if ch.finish_reason:
            out["finish"] = ch.finish_reason
    return out


def test_reasoning_goes_to_reasoning_content(oai):
    r = _ask(oai, "Say hello.")
    msg = r.choices[0].message
    assert msg.content == "Hello there, friend!"
    assert msg.reasoning_content.strip() == "A greeting is asked."
    assert msg.model_extra["reasoning"] == msg.reasoning_content  # vLLM's newer name, the same text
    s = _collect(_ask(oai, "Say hello.", stream=True))
    assert (s["reasoning"], s["content"], s["finish"]) == (msg.reasoning_content, msg.content, "stop")


def test_thinking_off_puts_the_answer_in_content(oai):
    r = _ask(oai, "Say hello.", thinking=False)
    msg = r.choices[0].message
    assert msg.content == "Hello there, friend!"
    assert getattr(msg, "reasoning_content", None) is None
    s = _collect(_ask(oai, "Say hello.", stream=True, thinking=False))
    assert (s["reasoning"], s["content"]) == ("", "Hello there, friend!")


def test_a_tool_call_is_parsed_with_an_id_and_finish_reason(oai):
    r = _ask(oai, "What is the weather in Paris?", tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and not ch.message.content
    (call,) = ch.message.tool_calls
    assert call.id and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "weather" in ch.message.reasoning_content


def test_several_calls_in_one_turn_streamed_like_openai(oai):
    whole = _ask(oai, "Compare the weather in Oslo and Rome.", tools=TOOLS).choices[0]
    assert [json.loads(c.function.arguments)["city"] for c in whole.message.tool_calls] == ["Oslo", "Rome"]
    s = _collect(_ask(oai, "Compare the weather in Oslo and Rome.", tools=TOOLS, stream=True))
    assert s["finish"] == "tool_calls" and s["content"] == ""
    assert sorted(s["calls"]) == [0, 1]
    for k, call in s["calls"].items():
        assert call["id"] and call["name"] == "get_weather"
        assert json.loads(call["arguments"]) == json.loads(whole.message.tool_calls[k].function.arguments)


def test_a_call_inside_think_is_not_a_call(oai):
    for stream in (False, True):
        r = _ask(oai, "Should I check the weather in Lima?", tools=TOOLS, stream=stream)
        if stream:
            s = _collect(r)
            assert not s["calls"] and s["finish"] == "stop"
            content, reasoning = s["content"], s["reasoning"]
        else:
            ch = r.choices[0]
            assert not ch.message.tool_calls and ch.finish_reason == "stop"
            content, reasoning = ch.message.content, ch.message.reasoning_content
        assert content == "No need: just look outside."
        assert "<tool_call>" in reasoning


def test_tool_calls_with_thinking_off(oai):
    r = _ask(oai, "Weather in Kyiv, tersely.", tools=TOOLS, thinking=False)
    (call,) = r.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Kyiv"}
    assert r.choices[0].finish_reason == "tool_calls"
    s = _collect(_ask(oai, "Weather in Kyiv, tersely.", tools=TOOLS, thinking=False, stream=True))
    assert json.loads(s["calls"][0]["arguments"]) == {"city": "Kyiv"}


def test_tool_choice_none_renders_no_tools_and_parses_nothing(oai):
    r = _ask(oai, "What is the weather in Paris?", tools=TOOLS, tool_choice="none")
    assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason != "tool_calls"


def test_json_schema_applies_after_the_thinking(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "cat", "schema": CAT, "strict": True}}
    r = _ask(oai, "Describe a cat as JSON.", response_format=fmt)
    msg = r.choices[0].message
    assert msg.reasoning_content.strip() == "A cat object."
    jsonschema.validate(json.loads(msg.content), CAT)
    s = _collect(_ask(oai, "Describe a cat as JSON.", response_format=fmt, stream=True))
    assert (s["reasoning"], s["content"]) == (msg.reasoning_content, msg.content)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_choice_after_thinking_gives_valid_calls(oai, choice):
    """The model thinks first (free, but it cannot end there), then writes calls held to the
    functions' schemas, in its own Hermes format, so it can stop after its last call."""
    for stream in (False, True):
        r = _ask(oai, "What is the weather in Paris?", tools=TOOLS, tool_choice=choice, stream=stream)
        if stream:
            s = _collect(r)
            finish, reasoning = s["finish"], s["reasoning"]
            calls = [(c["name"], c["arguments"]) for _, c in sorted(s["calls"].items())]
        else:
            ch = r.choices[0]
            finish, reasoning = ch.finish_reason, ch.message.reasoning_content
            calls = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls]
        assert finish == "tool_calls" and reasoning
        assert calls and (len(calls) == 1 or choice == "required")
        for name, arguments in calls:
            assert name == "get_weather"
            jsonschema.validate(json.loads(arguments), TOOLS[0]["function"]["parameters"])


def test_a_whole_tool_round_trip_renders(oai):
    """An agent loop's second turn: the assistant's call and the tool's answer go back in."""
    first = _ask(oai, "What is the weather in Paris?", tools=TOOLS).choices[0].message
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "Sunny, 21 C"}]
    r = oai.chat.completions.create(model=oai.models.list().data[0].id, messages=messages, tools=TOOLS,
                                    temperature=0, max_tokens=20)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 100  # the tools, the call and its result were all rendered


def test_stop_strings_and_max_tokens_cover_reasoning_too(oai):
    r = _ask(oai, "Say hello.", stop=["asked"])
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and not msg.content
    assert msg.reasoning_content.strip() == "A greeting is"
    r = _ask(oai, "Say hello.", max_tokens=3)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.content


def test_malformed_calls_stay_content():
    from fusedserve.coordinator.openai import tool_parser

    for text in ['<tool_call>{"name": "f", "arguments": {"a": </tool_call>', '<tool_call>no</tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"name": "f"']:
        content, calls = tool_parser.extract(text)
        assert calls == [] and content == text

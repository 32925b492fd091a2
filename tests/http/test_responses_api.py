"""OpenAI's Responses API through the official client's ``client.responses``, on a checkpoint that
really thinks and calls tools (``agent_model``): a function-tool round trip continued with
``previous_response_id``, a streamed response whose events rebuild the whole one, a JSON-schema
``text.format``, retrieve / delete / input items, and the bad requests as coded 400s."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from tests.agent_model import WEATHER, write_agent_model
from tests.support import running_server, serving_http

TOOL = {"type": "function", **WEATHER["function"]}  # the Responses shape: no "function" wrapper
# Bounded, so the grammar closes the object whatever text the tiny model would ramble on with
# (its float32 greedy path differs between the hosts' kernels).
CAT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                       "legs": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["name", "legs"], "additionalProperties": False}


@pytest.fixture(scope="module")
def url(ray_session, tmp_path_factory) -> Iterator[str]:
    model = write_agent_model(tmp_path_factory.mktemp("agent") / "model")
    with running_server(model=str(model), dtype="float32", max_batch=8, num_blocks=256) as coord, \
            serving_http(coord) as http:
        yield http.url


@pytest.fixture(scope="module")
def oai(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def test_a_function_tool_round_trip_continued_by_previous_response_id(oai):
    r = oai.responses.create(model="default", input="What is the weather in Paris?", tools=[TOOL],
                             temperature=0, max_output_tokens=120)
    kinds = [item.type for item in r.output]
    assert r.status == "completed" and kinds == ["reasoning", "function_call"], kinds
    call = r.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert r.output[0].content[0].text.strip() == "The user asks for the weather. I call the tool."
    follow = oai.responses.create(model="default", previous_response_id=r.id, tools=[TOOL], temperature=0,
                                  max_output_tokens=40,
                                  input=[{"type": "function_call_output", "call_id": call.call_id,
                                          "output": "Sunny, 21 C"}])
    assert follow.previous_response_id == r.id and follow.status in ("completed", "incomplete")
    # The continued prompt is the first turn, its call and the call's output: longer than the first.
    assert follow.usage.input_tokens > r.usage.input_tokens + 5
    assert oai.responses.retrieve(r.id).output[1].call_id == call.call_id
    items = oai.responses.input_items.list(follow.id).data
    assert [i.type for i in items] == ["function_call_output"]


def test_a_streamed_response_rebuilds_the_whole_one(oai):
    whole = oai.responses.create(model="default", input="Say hello.", temperature=0, max_output_tokens=60)
    assert whole.output_text == "Hello there, friend!"
    events = list(oai.responses.create(model="default", input="Say hello.", temperature=0,
                                       max_output_tokens=60, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert text == whole.output_text and thought == whole.output[0].content[0].text
    done = events[-1].response
    assert done.output_text == whole.output_text and done.usage.output_tokens == whole.usage.output_tokens
    for index, item in enumerate(done.output):  # each item's events in OpenAI's order
        own = [e.type for e in events if getattr(e, "output_index", None) == index]
        name = "output_text" if item.type == "message" else "reasoning_text"
        middle = ["response.content_part.added"] if item.type == "message" else []
        tail = ["response.content_part.done"] if item.type == "message" else []
        deltas = [t for t in own if t.endswith(".delta")]
        assert own == ["response.output_item.added", *middle, *deltas, f"response.{name}.done", *tail,
                       "response.output_item.done"], own
    assert oai.responses.retrieve(done.id).output_text == whole.output_text  # stored when it completed


def test_json_schema_text_format_validates(oai):
    r = oai.responses.create(model="default", input="Describe a cat as JSON.", temperature=0,
                             max_output_tokens=120,
                             text={"format": {"type": "json_schema", "name": "cat", "schema": CAT,
                                              "strict": True}})
    jsonschema.validate(json.loads(r.output_text), CAT)
    assert r.text.format.type == "json_schema"


def test_instructions_lead_and_a_cut_response_is_incomplete(oai):
    first = oai.responses.create(model="default", input="Say hello.", instructions="Be brief.", temperature=0,
                                 max_output_tokens=8)
    plain = oai.responses.create(model="default", input="Say hello.", temperature=0, max_output_tokens=8)
    assert first.usage.input_tokens > plain.usage.input_tokens  # the system turn is in the prompt
    assert first.instructions == "Be brief." and plain.instructions is None
    assert plain.status == "incomplete" and plain.incomplete_details.reason == "max_output_tokens"
    assert plain.usage.output_tokens == 8


def test_delete_and_the_bad_requests_are_coded(oai, url):
    r = oai.responses.create(model="default", input="Say hello.", temperature=0, max_output_tokens=8)
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with httpx.Client(base_url=url, timeout=60) as c:
        image = [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]
        unknown = {"input": "hi", "previous_response_id": "resp_nope"}
        for body, code in [(unknown, "previous_response_not_found"),
                           ({"input": []}, "bad_field"),
                           ({"input": "hi", "tools": [{"type": "web_search"}]}, "unsupported"),
                           ({"input": image}, "unsupported"),
                           ({"input": "hi", "text": {"format": {"type": "xml"}}}, "bad_field")]:
            resp = c.post("/v1/responses", json=body)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == code, (body, resp.text)
        unstored = c.post("/v1/responses", json={"input": "Say hello.", "store": False,
                                                 "max_output_tokens": 4})
        assert unstored.status_code == 200
        assert c.get(f"/v1/responses/{unstored.json()['id']}").status_code == 404

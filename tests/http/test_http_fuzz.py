"""Hypothesis throws request bodies at both OpenAI endpoints: nothing a client sends gets a 5xx.

Every answer is a 2xx, or a 4xx whose JSON body names a code; a stream ends without an internal
error; the gateway's generic 500 handler is never reached (its counter stays 0); the server stays
up and every KV block is free afterwards. The inputs that gave 500s before are named cases too.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.server.config import Limits
from tests.support import settled

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
# Any code point, lone surrogates included (JSON's \ud800 escapes make them).
any_text = st.text(st.characters(min_codepoint=0, max_codepoint=0x10FFFF, categories=None), max_size=30)
scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | any_text
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                      | st.dictionaries(any_text, inner, max_size=5), max_leaves=20)
prompts = st.text(max_size=60) | st.lists(st.integers(-2, 5000), max_size=8) | values
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | values, "content": any_text | values},
    optional={"tool_calls": values, "reasoning_content": values, "name": values}), max_size=4) | values
# Valid values of each field: a body is some of them, and at most one field made wild, so that most
# bodies generate (and stream) and each refusal names one field.
COMMON = {
    "model": st.just("default"),
    "max_tokens": st.integers(1, 8),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(0, 60),
    "min_p": st.floats(0, 0.5),
    "seed": st.integers(0, 2**64 - 1),
    "n": st.integers(1, 3),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=4), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}]),
    "structured_outputs": st.sampled_from([{"regex": "[ab]{1,4}"}, {"choice": ["yes", "no"]}]),
    "ignore_eos": st.booleans(),
}
COMPLETION = {**COMMON,
              "prompt": st.text(max_size=60) | st.lists(st.integers(0, 4095), min_size=1, max_size=8),
              "echo": st.booleans(), "logprobs": st.integers(0, 5)}
CHAT = {**COMMON, "messages": st.lists(st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=40)}),
            min_size=1, max_size=3),
        "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5),
        "tool_choice": st.sampled_from(["auto", "none"]),
        "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": st.booleans()})}
WILD_KEYS = st.sampled_from(sorted({*COMPLETION, *CHAT, "best_of", "suffix", "tools",
                                    "add_generation_prompt"}))


def _bodies(fields: dict, required: str) -> st.SearchStrategy[dict]:
    valid = st.dictionaries(st.sampled_from(sorted(fields)), st.none(), max_size=6).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in {*keys, required}}))
    wild = st.none() | st.tuples(WILD_KEYS, values | messages | prompts)
    return st.tuples(valid, wild).map(lambda vw: vw[0] if vw[1] is None else {**vw[0], vw[1][0]: vw[1][1]})


SERVER = dict(dtype="float32", max_batch=8, block_size=8, num_blocks=96, sampler_candidates=16,
              max_model_len=256, limits=Limits(max_tokens=16))


def _post(client: httpx.Client, path: str, raw: bytes) -> None:
    """One request: a 2xx (a stream read to its end) or a 4xx with a coded JSON error."""
    with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        text = r.read().decode("utf-8", "replace")
    assert r.status_code < 500, (r.status_code, text[:500])
    if r.status_code >= 400:
        err = json.loads(text)["error"]
        assert isinstance(err["code"], str) and err["code"] and err["message"], text
        event(f"{r.status_code} {err['code']}")  # the classes found (--hypothesis-show-statistics)
    else:
        event(f"{r.status_code}")
    assert '"code": "internal"' not in text and '"code":"internal"' not in text, text[:500]


@FUZZ
@given(_bodies(COMPLETION, "prompt"))
def test_completion_bodies(http, body):
    _post(http.client, "/v1/completions", json.dumps(body).encode())


@FUZZ
@given(_bodies(CHAT, "messages"))
def test_chat_bodies(http, body):
    _post(http.client, "/v1/chat/completions", json.dumps(body).encode())


@FUZZ
@given(values)
def test_any_json_value(http, value):
    _post(http.client, "/v1/chat/completions", json.dumps(value).encode())


@pytest.mark.parametrize("path,raw,code", [
    ("/v1/completions", b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", "bad_json"),
    ("/v1/completions", b'{"prompt": ' + b"[" * 65 + b"]" * 65 + b"}", "bad_json"),
    ("/v1/completions", b'{"prompt": "\\ud800 lone"}', "bad_text"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "bad_text"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                         "chat_template_kwargs": {"messages": []}}).encode(), "bad_field"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                         "chat_template_kwargs": {"add_generation_prompt": False}}).encode(),
     "bad_field"),
])
def test_inputs_that_gave_500s_are_coded_400s(http, path, raw, code):
    r = http.client.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text[:300]


def test_zeromq_structured_values_json_cannot_hold_are_refused(http):
    coord = http.coord
    with Client(coord.address) as c:
        for value in ({1: "a", "b": 2}, {"type": "object", "properties": {"a": {b"raw": 1}}}):
            c.send({"type": "generate", "id": "s", "prompt": "x", "max_tokens": 2,
                    "structured": {"kind": "json", "value": value}})
            reply = c.recv()
            assert reply["type"] == "error" and reply["code"] == "bad_structured_output", reply


def test_nothing_reached_the_generic_handler_and_the_server_is_whole(http):
    coord, gw, client = http.coord, http.gw, http.client
    assert gw.metrics.internal_errors._value.get() == 0
    assert 'fusedserve:http_internal_errors_total{model_name="default"} 0.0' in client.get("/metrics").text
    assert coord.alive()
    with Client(coord.address) as c:
        assert len(c.generate("still serving", max_tokens=4, ignore_eos=True)["token_ids"]) == 4
        stats = settled(c)
    assert stats["faults"]["request_errors"] == 0
    assert all(w["kv_blocks_used"] == 0 for w in stats["workers"])

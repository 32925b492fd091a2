"""The OpenAI-compatible HTTP API, driven against a real ``fusedserve serve --port``:
the official ``openai`` client for the happy paths, plain HTTP for everything else."""

from __future__ import annotations

import asyncio
import json
import re
import socket

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.openai.chat_template import ChatTemplate
from fusedserve.coordinator.sampling_params import SamplingParams
from tests.serve_proc import ServeProcess
from tests.support import settled, wait_for

TOKEN = "http-test-token-0123456789"
RC = dict(max_batch=16, block_size=16, num_blocks=256)
ARGS = ("--workers", "1", "--dtype", "float32", "--max-batch", "16", "--num-blocks", "256",
        "--max-prompt-tokens", "400", "--port", "0")


@pytest.fixture(scope="module")
def server(ray_session, tmp_path_factory):
    d = tmp_path_factory.mktemp("http")
    token_file = d / "token"
    token_file.write_text(TOKEN)
    srv = ServeProcess.start(d / "serve.log", *ARGS, "--auth-token-file", str(token_file))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def offline():
    eng = LLMEngine("default", dtype="float32", **RC)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http}/v1", api_key=TOKEN, max_retries=0)


def _auth() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


def _chat_ids(offline: LLMEngine, messages: list[dict]) -> list[int]:
    return offline.input.encode(ChatTemplate.from_dir(resolve_model("default")).render(messages))


def test_models_and_health(server, oai):
    assert [m.id for m in oai.models.list().data] == ["default"]
    r = httpx.get(f"{server.http}/health")
    assert r.status_code == 200 and r.json()["ok"] is True


def test_completion_equals_offline(oai, offline):
    prompt = "The capital of France is"
    want = offline.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    got = oai.completions.create(model="default", prompt=prompt, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(want.prompt_ids) and got.usage.completion_tokens == 12
    by_ids = oai.completions.create(model="default", prompt=want.prompt_ids, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == want.text


def test_completion_stream_equals_offline_and_ends_with_usage(oai, offline):
    prompt = "Once upon a time"
    want = offline.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    chunks = list(oai.completions.create(model="default", prompt=prompt, max_tokens=20, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.text
    if "\ufffd" not in want.text:
        assert not any("\ufffd" in c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_stop_strings_never_reach_the_stream(oai, offline):
    want = offline.generate(["Memory bandwidth"], SamplingParams(max_tokens=30, ignore_eos=True))[0].text
    stop = want[len(want) // 2: len(want) // 2 + 2]
    chunks = list(oai.completions.create(model="default", prompt="Memory bandwidth", max_tokens=30,
                                         temperature=0, stop=[stop], stream=True,
                                         extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks)
    assert text == want[: want.find(stop)] and chunks[-1].choices[0].finish_reason == "stop"


def test_chat_sync_and_stream_equal_offline(oai, offline):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello!"}]
    ids = _chat_ids(offline, messages)
    im_end = offline.tokenizer.token_id("<|im_end|>")
    want = offline.generate([ids], SamplingParams(max_tokens=16, stop_token_ids=[im_end]))[0]
    got = oai.chat.completions.create(model="default", messages=messages, max_tokens=16, temperature=0)
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(ids)
    chunks = list(oai.chat.completions.create(model="default", messages=messages, max_tokens=16,
                                              temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    off = oai.chat.completions.create(model="default", messages=messages, max_tokens=4, temperature=0,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    template = ChatTemplate.from_dir(resolve_model("default"))
    rendered = template.render(messages, enable_thinking=False)
    assert rendered.endswith("<think>\n\n</think>\n\n")
    assert off.usage.prompt_tokens == len(offline.input.encode(rendered)) > len(ids)


def test_logprobs(oai):
    c = oai.completions.create(model="default", prompt="hello", max_tokens=5, temperature=0, logprobs=3,
                               extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    # greedy: the sampled token is the most likely one
    assert all(max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    ch = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = ch.choices[0].logprobs.content
    assert len(content) == ch.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in content)


def _post(server, path: str, body, headers: dict | None = None, raw: bytes | None = None) -> httpx.Response:
    data = raw if raw is not None else json.dumps(body).encode()
    auth = _auth() if headers is None else headers
    return httpx.post(f"{server.http}{path}", content=data, timeout=60,
                      headers={"content-type": "application/json", **auth})


@pytest.mark.parametrize("body,raw,status,param", [
    (None, b"{not json", 400, None),
    (None, b'{"prompt": "x", "temperature": NaN}', 400, None),
    (None, b'{"prompt": "x", "top_p": Infinity}', 400, None),
    (None, b"[1, 2]", 400, None),
    ({"prompt": "x", "max_tokens": "ten"}, None, 400, "max_tokens"),
    ({"prompt": 5}, None, 400, "prompt"),
    ({"prompt": "x", "temperature": True}, None, 400, "temperature"),
    ({"prompt": "x", "temperature": 1e-320}, None, 400, None),
    ({"prompt": "x", "temperature": 500}, None, 400, None),
    ({"prompt": "x", "n": 100}, None, 400, "n"),
    ({"prompt": "x", "n": 2, "best_of": 4}, None, 400, "best_of"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, None, 400, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     None, 400, "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, None, 400,
     "structured_outputs"),
    ({"prompt": "x", "structured_outputs": {"json": {"properties": {"a": {"type": "no"}}}}}, None, 400, None),
    ({"prompt": "x", "structured_outputs": {"regex": "(unclosed"}}, None, 400, None),
    ({"prompt": "x", "structured_outputs": {"choice": []}}, None, 400, None),
    ({"prompt": "x", "model": "gpt-4"}, None, 404, "model"),
    ({"prompt": "word " * 800}, None, 413, None),
    ({"prompt": "x", "max_tokens": 10**6}, None, 400, None),
    ({"prompt": [1, 10**7]}, None, 400, None),
    # Integers beyond what a ZeroMQ frame can carry: refused, never a 500.
    ({"prompt": "x", "seed": 1180591620717411303424}, None, 400, "seed"),
    ({"prompt": "x", "seed": -(2**70)}, None, 400, "seed"),
    ({"prompt": "x", "max_tokens": 2**64}, None, 400, "max_tokens"),
    ({"prompt": "x", "top_k": 2**80}, None, 400, "top_k"),
    ({"prompt": "x", "logprobs": 2**65}, None, 400, "logprobs"),
    ({"prompt": [1, 2**70]}, None, 400, "prompt"),
    # Stop strings beyond the documented caps (SamplingParams: 64 strings of 256 characters).
    ({"prompt": "x", "stop": [f"stop string {i:027d}" for i in range(90_000)]}, None, 400, "stop"),
    ({"prompt": "x", "stop": ["s" * 257]}, None, 400, "stop"),
])
def test_bad_requests_get_openai_errors(server, body, raw, status, param):
    r = _post(server, "/v1/completions", body, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    assert err["param"] == param
    assert "Traceback" not in r.text


def test_auth_body_limits_and_unknown_fields(server):
    ok = {"prompt": "x", "max_tokens": 2, "some_future_field": {"a": 1}}
    assert _post(server, "/v1/completions", ok).status_code == 200  # unknown fields are ignored
    assert _post(server, "/v1/completions", ok, headers={}).status_code == 401
    r = _post(server, "/v1/completions", ok, headers={"Authorization": "Bearer wrong-token-wrong-token"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = _post(server, "/v1/completions", None, raw=b'{"prompt": "' + b"a" * (5 << 20) + b'"}')
    assert r.status_code == 413
    r = _post(server, "/v1/chat/completions", {"messages": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    hi = [{"role": "user", "content": "hi"}]
    for bad in ({"tools": "get_weather"}, {"tools": [{"type": "function", "function": {}}]},
                {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
                {"tool_choice": "required"},
                {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}):
        r = _post(server, "/v1/chat/completions", {"messages": hi, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] in ("tools", "tool_choice"), (bad, r.text)


def test_100_concurrent_streams_equal_offline(server, offline):
    prompts = [f"request {i}: the story goes" for i in range(100)]
    want = [o.text for o in offline.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]

    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.http}/v1", api_key=TOKEN, max_retries=0, timeout=300)

        async def one(p: str) -> str:
            stream = await client.completions.create(model="default", prompt=p, max_tokens=8, temperature=0,
                                                     stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream])
        try:
            return await asyncio.gather(*(one(p) for p in prompts))
        finally:
            await client.close()

    assert asyncio.run(main()) == want


def _metrics(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.http}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


ABORTED = ("fusedserve:request_success_total", (("finished_reason", "abort"), ("model_name", "default")))


def test_client_dropping_mid_stream_aborts_and_frees_blocks(server):
    before = _metrics(server).get(ABORTED, 0)
    body = {"prompt": "a long story", "max_tokens": 900, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.http}/v1/completions", json=body, headers=_auth(), timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
    assert any(line.startswith("data: ") for line in got)
    with Client(server.address, token=TOKEN) as c:
        stats = settled(c)
    assert all(w["kv_blocks_used"] == 0 for w in stats["workers"])
    wait_for(lambda: _metrics(server).get(ABORTED, 0) >= before + 1, 10, "the abort to be counted")


def test_metrics_count_what_was_served(server, oai):
    with Client(server.address, token=TOKEN) as c:
        settled(c)  # nothing of an earlier test still in a launch
    m0 = _metrics(server)
    n, tokens = 5, 7
    for i in range(n):
        oai.completions.create(model="default", prompt=f"count {i}", max_tokens=tokens, temperature=0,
                               extra_body={"ignore_eos": True})
    m1 = _metrics(server)

    model = (("model_name", "default"),)

    def delta(name: str, labels: tuple = ()) -> float:
        key = (name, tuple(sorted(labels + model)))
        return m1.get(key, 0) - m0.get(key, 0)

    assert delta("fusedserve:request_success_total", (("finished_reason", "length"),)) == n
    assert delta("fusedserve:generation_tokens_total") == n * tokens
    assert delta("fusedserve:prompt_tokens_total") > 0
    assert delta("fusedserve:time_to_first_token_seconds_count") == n
    assert m1[("fusedserve:workers", model)] == 1 and m1[("fusedserve:kv_blocks_used", model)] == 0
    assert m1[("fusedserve:kv_blocks_free", model)] == RC["num_blocks"]
    assert m1[("fusedserve:num_requests_running", model)] == 0
    assert m1[("fusedserve:kv_cache_usage_perc", model)] == 0
    assert delta("fusedserve:prefix_cache_queries_total") > 0
    # Greedy: 4 bytes (an id) come back per generated token; speculation (on by default) adds an id
    # per rejected proposal row and a count per speculating request, and nothing else.
    rejected = delta("fusedserve:spec_decode_num_draft_tokens_total") - \
        delta("fusedserve:spec_decode_num_accepted_tokens_total")
    drafts = delta("fusedserve:spec_decode_num_drafts_total")
    assert delta("fusedserve:d2h_bytes_total", (("worker", "w0"),)) == (n * tokens + rejected + drafts) * 4
    assert ("fusedserve:faults_total", (("kind", "request_errors"), *model)) in m1


def test_bench_serve_takes_the_openai_base_url_as_serve_prints_it(server):
    """``serve`` prints its API as ``http://host:port/v1`` (what OpenAI clients take): bench serve
    accepts that as well as the server's root."""
    import asyncio

    from fusedserve.coordinator.openai.bench_serve import BenchConfig, run

    s = asyncio.run(run(BenchConfig(server.http + "/v1/", api_key=TOKEN, num_prompts=2, input_len=4,
                                    output_len=3, progress=False)))
    assert s["completed"] == 2 and s["failed"] == 0


def test_bench_serve_loads_the_api_and_reports(server, tmp_path, capsys):
    from fusedserve.coordinator import cli

    out = tmp_path / "bench.json"
    rc = cli.main(["bench", "serve", "--base-url", server.http, "--api-key", TOKEN, "--num-prompts", "12",
                   "--max-concurrency", "4", "--request-rate", "50", "--input-len", "8", "--output-len", "6",
                   "--range-ratio", "0.5", "--seed", "3", "--no-progress", "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Request throughput (req/s)" in printed and "TTFT p50/p90/p99 (ms)" in printed
    s = json.loads(out.read_text())
    assert s["completed"] == 12 and s["failed"] == 0 and s["output_throughput"] > 0
    assert 12 * 3 <= s["output_tokens"] <= 12 * 9  # lengths drawn from [3, 9]
    assert 0 < s["ttft_ms_p50"] <= s["ttft_ms_p90"] <= s["ttft_ms_p99"]
    assert 0 < s["itl_ms_p50"] <= s["itl_ms_p99"]
    # vLLM bench serve's names, which its users' scripts read
    assert s["p99_ttft_ms"] == s["ttft_ms_p99"] and s["median_ttft_ms"] > 0 and s["mean_e2el_ms"] > 0
    assert s["total_output_tokens"] == s["output_tokens"] and s["total_input_tokens"] > 0
    assert 0 < s["mean_tpot_ms"] and s["std_itl_ms"] >= 0


def test_a_non_streaming_client_that_leaves_has_its_request_aborted(server):
    key = ("fusedserve:request_success_total", (("finished_reason", "abort"), ("model_name", "default")))
    before = _metrics(server).get(key, 0)
    body = json.dumps({"prompt": "a long story", "max_tokens": 900, "temperature": 0,
                       "ignore_eos": True}).encode()
    host, port = server.http.removeprefix("http://").rsplit(":", 1)
    with Client(server.address, token=TOKEN) as c:
        running = c.stats()["running"]
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        # The client leaves once its request runs, however fast this machine generates.
        wait_for(lambda: c.stats()["running"] > running, 60, "the request to run")
        sock.close()
        wait_for(lambda: _metrics(server).get(key, 0) >= before + 1, 20, "the abort to be counted")
        stats = settled(c, timeout_s=20)
    assert all(w["kv_blocks_used"] == 0 for w in stats["workers"])


@pytest.mark.parametrize("code,status", [
    ("too_many_requests", 429), ("server_busy", 429), ("no_workers", 503), ("shutdown", 503),
    ("unauthorized", 401), ("prompt_too_long", 413), ("bad_param", 400), ("token_out_of_range", 400),
    ("sampling_error", 500), ("grammar_error", 400), ("grammar_timeout", 400), ("bad_structured_output", 400),
    ("bad_prompt", 400),
])
def test_coordinator_codes_map_to_http_statuses(code, status):
    from fusedserve.coordinator.openai.protocol import ApiError

    err = ApiError.from_reply({"type": "error", "code": code, "message": "m"})
    assert err.status == status and err.body()["error"]["code"] == code


# ----------------------------------------------------------- what Qwen3 clients send

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                                           "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                           "tags": {"type": "array", "items": {"enum": ["py", "c"]},
                                                    "maxItems": 3}},
          "required": ["title", "year", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                     "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


def test_json_schema_and_json_object_on_chat(oai):
    messages = [{"role": "user", "content": "Describe a book."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        r = oai.chat.completions.create(model="default", messages=messages, max_tokens=80, temperature=1.0,
                                        seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    whole = oai.chat.completions.create(model="default", messages=messages, max_tokens=80, temperature=0,
                                        response_format=fmt).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="default", messages=messages, max_tokens=80, temperature=0, response_format=fmt, stream=True)
        if c.choices)
    assert streamed == whole
    obj = oai.chat.completions.create(model="default", messages=messages, max_tokens=60, temperature=0,
                                      response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)


def test_structured_outputs_on_completions(oai):
    def ask(so: dict, max_tokens: int = 40) -> str:
        r = oai.completions.create(model="default", prompt="The answer is", max_tokens=max_tokens,
                                   temperature=1.0, seed=3, extra_body={"structured_outputs": so})
        return r.choices[0].text
    assert ask({"choice": ["left", "right"]}) in ("left", "right")
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", ask({"regex": r"[A-Z]{2}-[0-9]{3}"}))
    assert re.fullmatch(r"(yes|no)!", ask({"grammar": 'root ::= ("yes" | "no") "!"'}))
    jsonschema.validate(json.loads(ask({"json": SCHEMA}, max_tokens=80)), SCHEMA)
    fmt = {"type": "json_schema", "json_schema": {"name": "book", "schema": SCHEMA}}
    r = oai.completions.create(model="default", prompt="{", max_tokens=80, temperature=0,
                               extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


def test_a_named_tool_choice_makes_even_the_default_model_call_it(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    calls = []
    for seed in range(3):
        r = oai.chat.completions.create(model="default", messages=messages, tools=[WEATHER],
                                        tool_choice=choice, max_tokens=80, temperature=0.8, seed=seed)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        (call,) = ch.message.tool_calls
        assert call.id.startswith("call_") and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        calls.append(call)
    chunks = list(oai.chat.completions.create(model="default", messages=messages, tools=[WEATHER],
                                              tool_choice=choice, max_tokens=80, temperature=0.8, seed=0,
                                              stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    streamed = json.loads("".join(d.function.arguments or "" for d in deltas))
    assert streamed == json.loads(calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_n_choices_share_a_prompt_and_draw_their_own_seeds(oai):
    kw = dict(model="default", prompt="The module provides", max_tokens=12, temperature=1.0, seed=11,
              extra_body={"ignore_eos": True})
    r = oai.completions.create(n=3, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.text for c in r.choices]
    assert len(set(texts)) == 3  # three seed streams
    assert r.usage.completion_tokens == 36 and r.usage.prompt_tokens == r.usage.total_tokens - 36
    one = oai.completions.create(n=1, **kw).choices[0].text
    assert one == texts[0]  # choice 0 draws from the request's seed; choice i from seed + i
    streamed = {i: "" for i in range(3)}
    for c in oai.completions.create(n=3, stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert [streamed[i] for i in range(3)] == texts
    chat = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}], n=2,
                                       max_tokens=6, temperature=1.0, seed=5)
    assert len(chat.choices) == 2 and chat.choices[1].index == 1


def test_echo_gives_the_prompt_and_its_logprobs(oai, offline):
    prompt = "The quick brown fox jumps over the lazy dog."
    want = offline.generate([prompt], SamplingParams(max_tokens=3, prompt_logprobs=2, ignore_eos=True))[0]
    r = oai.completions.create(model="default", prompt=prompt, max_tokens=3, temperature=0, logprobs=2,
                               echo=True, extra_body={"ignore_eos": True})
    ch = r.choices[0]
    assert ch.text.startswith(prompt) and len(ch.text) > len(prompt)
    lp = ch.logprobs
    n = len(want.prompt_ids)
    assert len(lp.tokens) == n + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx(want.prompt_logprobs[1:], abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len(prompt)
    only = oai.completions.create(model="default", prompt=prompt, max_tokens=0, temperature=0, logprobs=0,
                                  echo=True)
    assert only.choices[0].text == prompt and len(only.choices[0].logprobs.tokens) == n
    assert only.usage.completion_tokens == 0
    chunks = list(oai.completions.create(model="default", prompt=prompt, max_tokens=3, temperature=0,
                                         logprobs=2, echo=True, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text
    assert chunks[0].choices[0].logprobs.token_logprobs[1:n] == pytest.approx(lp.token_logprobs[1:n])


def test_sagemaker_ping_and_invocations_and_vllm_load(server, oai):
    """/ping answers as /health; /invocations routes a body with messages to chat and one with
    a prompt to completions, behind the same token; /load counts the requests the server holds."""
    assert httpx.get(f"{server.http}/ping").status_code == 200
    assert httpx.post(f"{server.http}/ping").json()["ok"] is True
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    assert httpx.post(f"{server.http}/invocations", json=body).status_code == 401  # the token stands
    r = httpx.post(f"{server.http}/invocations", json=body, headers=_auth(), timeout=60)
    want = oai.completions.create(model="default", **{k: v for k, v in body.items() if k != "ignore_eos"},
                                  extra_body={"ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.choices[0].text
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{server.http}/invocations", json=chat, headers=_auth(), timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = httpx.post(f"{server.http}/invocations", json={"input": "x"}, headers=_auth())
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_field"
    load = httpx.get(f"{server.http}/load", headers=_auth())
    assert load.status_code == 200 and load.json() == {"server_load": 0}


def test_prompt_logprobs_as_vllm_returns_them(server, offline):
    """vLLM's ``prompt_logprobs``: per prompt token (None first) the token's own logprob and the
    top ones, by id, with rank and decoded text; equal to the offline engine's."""
    prompt = "The quick brown fox jumps over the lazy dog."
    want = offline.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    body = {"model": "default", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 2}
    r = httpx.post(f"{server.http}/v1/completions", json=body, headers=_auth(), timeout=60).json()
    got = r["choices"][0]["prompt_logprobs"]
    assert len(got) == len(want.prompt_ids) and got[0] is None
    for pos in range(1, len(got)):
        own = got[pos][str(want.prompt_ids[pos])]
        assert own["logprob"] == pytest.approx(want.prompt_logprobs[pos], abs=1e-4)
        assert own["decoded_token"] and (own["rank"] is None or 1 <= own["rank"] <= 2)
        ranks = sorted(e["rank"] for e in got[pos].values() if e["rank"] is not None)
        assert ranks == [1, 2]
    chat = httpx.post(f"{server.http}/v1/chat/completions", headers=_auth(), timeout=60, json={
        "model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    streamed = httpx.post(f"{server.http}/v1/completions", json={**body, "stream": True}, headers=_auth())
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
    for bad in (-1, 21, "2"):
        r = httpx.post(f"{server.http}/v1/completions", json={**body, "prompt_logprobs": bad},
                       headers=_auth())
        assert r.status_code == 400, bad


def test_continuous_usage_stats_ride_on_every_chunk(oai):
    chunks = list(oai.completions.create(model="default", prompt="The with statement", max_tokens=5,
                                         stream=True, extra_body={"ignore_eos": True},
                                         stream_options={"include_usage": True,
                                                         "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[-1] == 5 == chunks[-1].usage.completion_tokens
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    plain = list(oai.completions.create(model="default", prompt="The with statement", max_tokens=3,
                                        stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices)  # only the last chunk, as before


def test_tokens_as_token_ids_name_logprobs_by_id(oai):
    kw = dict(model="default", prompt="The with statement", max_tokens=3, temperature=0, logprobs=2)
    plain = oai.completions.create(**kw).choices[0].logprobs
    by_id = oai.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for t in by_id.tokens) and by_id.tokens != plain.tokens
    assert by_id.token_logprobs == plain.token_logprobs
    assert all(re.fullmatch(r"token_id:\d+", t) for step in by_id.top_logprobs for t in step)
    chat = oai.chat.completions.create(model="default", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, logprobs=True, top_logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True})
    assert all(e.token.startswith("token_id:") for e in chat.choices[0].logprobs.content)


def test_tokenize_returns_token_strings_when_asked(server):
    url = f"{server.http}/tokenize"
    r = httpx.post(url, json={"prompt": "The with statement", "return_token_strs": True},
                   headers=_auth()).json()
    assert len(r["token_strs"]) == r["count"] == len(r["tokens"]) and all(r["token_strs"])
    assert httpx.post(url, json={"prompt": "x"}, headers=_auth()).json()["token_strs"] is None
    assert httpx.post(url, json={"prompt": "x", "return_token_strs": 1}, headers=_auth()).status_code == 400

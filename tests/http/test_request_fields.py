"""Every request field OpenAI documents for completions and chat completions, and vLLM's extra
sampling fields, is either honoured (the response changes as the field says) or refused with 400:
none is silently ignored."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from tests.support import running_server, serving_http

N = 24  # tokens: enough that the plain output repeats one (what the penalties act on)
BASE = {"prompt": "The with statement", "max_tokens": N, "temperature": 0, "ignore_eos": True}
CHAT = {"messages": [{"role": "user", "content": "What does the with statement do?"}], "max_tokens": N,
        "temperature": 0, "ignore_eos": True}


SERVER = dict(dtype="float32", max_batch=8, block_size=16, num_blocks=256, max_model_len=512)


def _post(client: httpx.Client, chat: bool, body: dict) -> httpx.Response:
    return client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)


def _text(r: dict, chat: bool) -> str:
    """What was generated: a chat message's reasoning and content, or a completion's text."""
    c = r["choices"][0]
    if not chat:
        return c["text"]
    return (c["message"].get("reasoning_content") or "") + (c["message"].get("content") or "")


REFUSED = [  # (chat, field, value)
    (False, "suffix", "tail"), (False, "best_of", 3),
    (True, "audio", {"voice": "alloy", "format": "wav"}), (True, "function_call", "auto"),
    (True, "functions", [{"name": "f", "parameters": {}}]), (True, "metadata", {"k": "v"}),
    (True, "modalities", ["text", "audio"]), (True, "parallel_tool_calls", False),
    (True, "prediction", {"type": "content", "content": "x"}), (True, "reasoning_effort", "high"),
    (True, "service_tier", "flex"), (True, "store", True), (True, "web_search_options", {}),
    (False, "use_beam_search", True), (False, "length_penalty", 0.5), (False, "skip_special_tokens", False),
    (False, "spaces_between_special_tokens", False), (True, "continue_final_message", True),
    (False, "add_special_tokens", True), (True, "chat_template", "{{ messages }}"),
    (True, "documents", [{}]),
    (True, "echo", True), (False, "priority", 1), (False, "logits_processors", ["x"]),
    (False, "cache_salt", "s"),
    (False, "kv_transfer_params", {}),
    (False, "vllm_xargs", {"a": 1}), (False, "mm_processor_kwargs", {"a": 1}),
]


@pytest.mark.parametrize("chat,field,value", REFUSED, ids=[f[1] for f in REFUSED])
def test_fields_this_server_does_not_do_are_refused(http, chat, field, value):
    client = http.client
    r = _post(client, chat, {**(CHAT if chat else BASE), field: value})
    assert r.status_code == 400, (field, r.status_code, r.text[:300])
    assert r.json()["error"]["param"] == field


def _changes(field: str, value, check) -> tuple:
    return field, value, check


def _differs(plain: dict, got: dict, chat: bool) -> bool:
    return _text(got, chat) != _text(plain, chat)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text)


HONOURED = [
    # completions and chat alike (checked on both)
    _changes("max_tokens", 3, lambda p, g, c, t: g["usage"]["completion_tokens"] == 3),
    _changes("temperature", 1.5, lambda p, g, c, t: True),  # with the seed below: see "seed"
    _changes("seed", 7, lambda p, g, c, t: True),
    _changes("top_p", 0.000001, lambda p, g, c, t: True),  # only the most likely token: as greedy
    _changes("stop", "ZZZ-never", lambda p, g, c, t: _text(g, c) == _text(p, c)),
    _changes("n", 2, lambda p, g, c, t: len(g["choices"]) == 2),
    _changes("frequency_penalty", 2.0, lambda p, g, c, t: _differs(p, g, c)),
    _changes("presence_penalty", 2.0, lambda p, g, c, t: _differs(p, g, c)),
    _changes("repetition_penalty", 2.0, lambda p, g, c, t: _differs(p, g, c)),
    _changes("logit_bias", {"42": 100}, lambda p, g, c, t: _text(g, c) == t.decode([42]) * N),
    _changes("top_k", 1, lambda p, g, c, t: _text(g, c) == _text(p, c)),
    _changes("min_p", 1.0, lambda p, g, c, t: _text(g, c) == _text(p, c)),
    _changes("ignore_eos", False, lambda p, g, c, t: g["usage"]["completion_tokens"] <= N),
    _changes("min_tokens", N, lambda p, g, c, t: g["usage"]["completion_tokens"] == N),
    _changes("allowed_token_ids", [42, 43], lambda p, g, c, t: set(_text(g, c)) <= set(t.decode([42, 43]))),
    _changes("truncate_prompt_tokens", 1, lambda p, g, c, t: g["usage"]["prompt_tokens"] == 1),
    _changes("request_id", "my-id-1", lambda p, g, c, t: g["id"] == "my-id-1"),
    _changes("stream_options", {"include_usage": True}, lambda p, g, c, t: True),  # without stream: nothing
    _changes("structured_outputs", {"regex": "[ab]{3}"},
             lambda p, g, c, t: len(_text(g, c)) == 3 and set(_text(g, c)) <= {"a", "b"}),
    _changes("guided_choice", ["yes", "no"], lambda p, g, c, t: _text(g, c) in ("yes", "no")),
    _changes("response_format", {"type": "json_object"}, lambda p, g, c, t: _text(g, c).startswith("{")),
]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_documented_fields_change_the_response_as_they_say(http, chat):
    client, tok = http.client, http.coord.tokenizer
    base = CHAT if chat else BASE
    plain = _post(client, chat, base).json()
    for field, value, check in HONOURED:
        if check is None:
            continue
        body = {**base, field: value}
        if field in ("temperature", "seed"):
            body = {**base, "temperature": 1.5, "seed": 7}
        r = _post(client, chat, body)
        assert r.status_code == 200, (field, r.text[:300])
        assert check(plain, r.json(), chat, tok), (field, r.json())
    # Sampled: two seeds draw differently, one seed twice the same; a tiny top_p is greedy again.
    hot = [_post(client, chat, {**base, "temperature": 1.5, "seed": s}).json() for s in (1, 2, 1)]
    assert _text(hot[0], chat) != _text(hot[1], chat) and _text(hot[0], chat) == _text(hot[2], chat)
    tiny = _post(client, chat, {**base, "temperature": 1.5, "seed": 1, "top_p": 1e-6}).json()
    assert _text(tiny, chat) == _text(plain, chat)


def test_logprobs_echo_stream_stop_and_field_specific_ones(http, caplog):
    client, tok = http.client, http.coord.tokenizer
    r = _post(client, False, {**BASE, "logprobs": 2}).json()
    assert len(r["choices"][0]["logprobs"]["top_logprobs"]) == N
    r = _post(client, True, {**CHAT, "logprobs": True, "top_logprobs": 2}).json()
    assert len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2
    plain = _post(client, False, BASE).json()["choices"][0]["text"]
    echoed = _post(client, False, {**BASE, "echo": True}).json()["choices"][0]["text"]
    assert echoed == BASE["prompt"] + plain
    stop = plain[2:5]
    cut = _post(client, False, {**BASE, "stop": [stop]}).json()["choices"][0]["text"]
    kept = _post(client, False, {**BASE, "stop": [stop], "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == cut + stop
    first = tok.encode(plain)[0]
    r = _post(client, False, {**BASE, "stop_token_ids": [first]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1
    word = plain.split()[0]
    r = _post(client, False, {**BASE, "bad_words": [word]}).json()
    assert word not in r["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json={**BASE, "stream": True,
                                                          "stream_options": {"include_usage": True}}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == plain
    assert events[-1]["usage"]["completion_tokens"] == N
    no_gen = _post(client, True, {**CHAT, "add_generation_prompt": False}).json()
    assert no_gen["usage"]["prompt_tokens"] < _post(client, True, CHAT).json()["usage"]["prompt_tokens"]
    think = _post(client, True, {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert think["usage"]["prompt_tokens"] > _post(client, True, CHAT).json()["usage"]["prompt_tokens"]
    schema = {"type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    forced = _post(client, True, {**CHAT, "max_tokens": 80, "ignore_eos": False, "tools": tools,
                                  "tool_choice": {"type": "function", "function": {"name": "f"}}}).json()
    assert forced["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f"
    with caplog.at_level(logging.INFO, logger="fusedserve.coordinator.openai.gateway"):
        assert _post(client, False, {**BASE, "user": "alice-42"}).status_code == 200
    assert "alice-42" in caplog.text, "the end user is recorded with the request"


def test_a_trusted_server_renders_a_request_s_own_chat_template(ray_session):
    with running_server(dtype="float32", max_batch=4, block_size=16, num_blocks=64,
                        max_model_len=256) as coord:
        with serving_http(coord, trust_request_chat_template=True) as server, \
                httpx.Client(base_url=server.url, timeout=60) as client:
            own = "{% for m in messages %}Q: {{ m.content }}\nA:{% endfor %}"
            r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "chat_template": own})
            assert r.status_code == 200, r.text
            want = len(coord.tokenizer.encode("Q: What does the with statement do?\nA:"))
            assert r.json()["usage"]["prompt_tokens"] == want


def test_tokenize_detokenize_and_version(http):
    client, tok = http.client, http.coord.tokenizer
    text = "The year 4096 and 東京 🙂"
    r = client.post("/tokenize", json={"prompt": text}).json()
    assert r["tokens"] == tok.encode(text) and r["count"] == len(r["tokens"]) and r["max_model_len"] == 512
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": text}
    chat = client.post("/tokenize", json={"messages": CHAT["messages"]}).json()
    assert chat["count"] == _post(client, True, {**CHAT, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    assert client.post("/detokenize", json={"tokens": [10**7]}).status_code == 400
    assert client.post("/tokenize", json={"prompt": 5}).status_code == 400
    assert client.get("/version").json()["version"]
    assert client.get("/v1/models").json()["data"][0]["max_model_len"] == 512


def test_the_grafana_dashboard_names_only_exported_metrics(http):
    """Every expression of deploy/grafana_dashboard.json names series /metrics exports (a histogram
    by its _bucket, a counter by its _total), after some traffic."""
    import re
    from pathlib import Path

    from prometheus_client.parser import text_string_to_metric_families

    client = http.client
    assert _post(client, False, BASE).status_code == 200
    text = client.get("/metrics").text
    exported = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    path = Path(__file__).resolve().parents[2] / "deploy" / "grafana_dashboard.json"
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs.append(dashboard["templating"]["list"][0]["query"])
    names = {n for e in exprs for n in re.findall(r"fusedserve:[A-Za-z0-9_:]+", e)}
    assert len(names) >= 14 and names <= exported, names - exported


# What vLLM's own Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json) queries,
# its vllm: prefix swapped for ours: that dashboard works on this server with the prefix changed.
VLLM_DASHBOARD = ("e2e_request_latency_seconds_bucket", "e2e_request_latency_seconds_sum",
                  "e2e_request_latency_seconds_count", "prompt_tokens_total", "generation_tokens_total",
                  "time_per_output_token_seconds_bucket", "time_per_output_token_seconds_sum",
                  "time_per_output_token_seconds_count", "num_requests_running", "num_requests_swapped",
                  "num_requests_waiting", "time_to_first_token_seconds_bucket",
                  "time_to_first_token_seconds_sum", "time_to_first_token_seconds_count",
                  "gpu_cache_usage_perc", "cpu_cache_usage_perc",
                  "request_prompt_tokens_bucket", "request_generation_tokens_bucket", "request_success_total",
                  "request_queue_time_seconds_sum", "request_prefill_time_seconds_sum",
                  "request_decode_time_seconds_sum", "request_max_num_generation_tokens_sum")
# The rest of vLLM's request metrics, which its newer dashboards and alerts read.
VLLM_MORE = ("request_inference_time_seconds_bucket", "iteration_tokens_total_bucket",
             "request_params_n_bucket", "request_params_max_tokens_bucket",
             "inter_token_latency_seconds_bucket",
             "kv_cache_usage_perc", "request_time_per_output_token_seconds_bucket")


def test_every_metric_vllms_dashboard_queries_is_exported(http):
    from prometheus_client.parser import text_string_to_metric_families

    client = http.client
    assert _post(client, False, {**BASE, "n": 2, "temperature": 1.0}).status_code == 200
    text = client.get("/metrics").text
    samples = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    missing = [n for n in VLLM_DASHBOARD + VLLM_MORE if "fusedserve:" + n not in samples]
    assert not missing, missing
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in families["fusedserve:" + name].samples
                if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"]

    assert bounds("time_to_first_token_seconds")[-1] == 2560.0  # vLLM's ranges
    assert bounds("e2e_request_latency_seconds")[-1] == 7680.0
    assert bounds("request_prompt_tokens")[:4] == [1, 2, 5, 10] and bounds("request_prompt_tokens")[-1] <= 512
    assert bounds("request_params_n") == [1, 2, 5, 10, 20]
    n = {s.labels["le"]: s.value for s in families["fusedserve:request_params_n"].samples
         if s.name.endswith("_bucket")}
    assert n["2.0"] - n["1.0"] >= 1  # the n=2 request
    steps = {s.labels["le"]: s.value for s in families["fusedserve:iteration_tokens_total"].samples
             if s.name.endswith("_bucket")}
    assert steps["+Inf"] >= N  # a launch per generated token at least


def test_a_qwen3_coder_server_forces_and_reads_xml_calls(http):
    """--tool-call-parser qwen3_coder: a named or required tool choice holds the output to Qwen's
    XML calls (values typed by the schema) and reads them back, whole and streamed alike."""
    tool = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                         "nights": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "breakfast": {"type": "boolean"}},
        "required": ["city", "nights", "breakfast"]}}}
    body = {**CHAT, "max_tokens": 80, "temperature": 0.7, "seed": 1, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "book"}}}
    with serving_http(http.coord, tool_call_parser="qwen3_coder") as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert whole["finish_reason"] == "tool_calls", whole
        (call,) = whole["message"]["tool_calls"]
        args = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "book" and set(args) == {"city", "nights", "breakfast"}
        assert isinstance(args["nights"], int) and isinstance(args["breakfast"], bool)
        assert args["city"] in ("Paris", "Rome") and 1 <= args["nights"] <= 9
        lines = client.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
        assert deltas[0]["function"]["name"] == "book"
        assert json.loads("".join(d["function"].get("arguments", "") for d in deltas)) == args
        required = client.post("/v1/chat/completions", json={**body, "tool_choice": "required"}).json()
        assert required["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "book"


def test_enable_log_requests_logs_each_request_and_nothing_without_it(http, caplog):
    with caplog.at_level(logging.INFO):
        assert _post(http.client, False, {**BASE, "max_tokens": 2}).status_code == 200
        assert "fusedserve.requests" not in caplog.text
        with serving_http(http.coord, enable_log_requests=True) as server, \
                httpx.Client(base_url=server.url, timeout=60) as client:
            body = {**BASE, "max_tokens": 2, "request_id": "logged-req-1"}
            assert _post(client, False, body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "fusedserve.requests"]
    assert len(lines) == 1 and "logged-req-1" in lines[0] and "'max_tokens': 2" in lines[0], lines

"""One HTTP client cannot starve the others: limits count per end client (its API key and address),
not per the gateway's one connection to the coordinator, and a refusal says when to come back."""

from __future__ import annotations

import threading

import httpx

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.server.config import Limits
from tests.support import settled

PER_CLIENT = 2


SERVER = dict(dtype="float32", max_batch=8, block_size=16, num_blocks=128, max_model_len=512,
              limits=Limits(max_requests_per_client=PER_CLIENT))
GATEWAY = dict(max_prompt_chars=2000)


def _client(url: str, source: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=120, transport=httpx.HTTPTransport(local_address=source))


def test_a_client_at_its_limit_gets_429s_while_another_is_served(http):
    coord, url = http.coord, http.url
    greedy, other = _client(url, "127.0.0.2"), _client(url, "127.0.0.1")
    opened = threading.Barrier(PER_CLIENT + 1)
    streams: list[int] = []

    def long_stream() -> None:  # holds one of the greedy client's slots for a while
        body = {"prompt": "a long story", "max_tokens": 300, "ignore_eos": True, "stream": True}
        with greedy.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(lines)
            opened.wait(60)
            streams.append(sum(1 for line in lines if line.startswith("data: {")))

    threads = [threading.Thread(target=long_stream) for _ in range(PER_CLIENT)]
    for t in threads:
        t.start()
    opened.wait(60)
    try:
        refused = greedy.post("/v1/completions", json={"prompt": "one more", "max_tokens": 4})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1", refused.text
        assert refused.json()["error"]["code"] == "too_many_requests"
        # Meanwhile another client is served, up to its own limit at a time.
        for i in range(3):
            body = {"prompt": f"question {i}", "max_tokens": 8, "ignore_eos": True}
            r = other.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8, r.text
    finally:
        for t in threads:
            t.join(120)
    assert len(streams) == PER_CLIENT and all(n >= 300 for n in streams)
    with Client(coord.address) as c:
        assert all(w["kv_blocks_used"] == 0 for w in settled(c)["workers"])


def test_text_past_the_character_cap_is_refused_before_tokenizing(http):
    url = http.url
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": "x" * 2001})
        assert r.status_code == 413 and r.json()["error"]["code"] == "prompt_too_long"
        r = c.post("/v1/completions", json={"prompt": ["x" * 1000, "y" * 1001]})
        assert r.status_code == 413
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 2001}]})
        assert r.status_code == 413 and r.json()["error"]["param"] == "prompt"
        r = c.post("/v1/completions", json={"prompt": "x" * 200, "max_tokens": 2})
        assert r.status_code == 200, r.text

"""Routing through a served 2-worker server: every follow-up turn of a multi-turn chat finds its
whole history cached on its worker (the policy itself: tests/unit/test_routing_policy.py)."""

from __future__ import annotations

import threading

import httpx
import pytest

from fusedserve.coordinator.client import Client, ServerError
from tests.support import running_server, serving_http

SESSIONS, TURNS = 6, 3


@pytest.fixture(scope="module")
def served(ray_session):
    with running_server(workers=2, dtype="float32", max_batch=8, block_size=16, num_blocks=256,
                        max_model_len=1024) as coord:
        with serving_http(coord) as http:
            yield coord, http.url


def _chat(url: str, session: int, results: list, errors: list) -> None:
    messages = [{"role": "system", "content": f"Session {session}: " + "You answer questions. " * 20}]
    try:
        with httpx.Client(base_url=url, timeout=300) as c:
            for turn in range(TURNS):
                messages.append({"role": "user", "content": f"Question {turn} of session {session}?"})
                r = c.post("/v1/chat/completions", json={"model": "default", "messages": messages,
                                                         "max_tokens": 12, "temperature": 0})
                r.raise_for_status()
                body = r.json()
                results.append((session, turn, body["usage"]))
                messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def test_every_follow_up_turn_finds_its_history_on_its_worker(served):
    coord, url = served
    results: list = []
    errors: list = []
    threads = [threading.Thread(target=_chat, args=(url, s, results, errors)) for s in range(SESSIONS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    usage = {(s, t): u for s, t, u in results}
    for s in range(SESSIONS):
        for t in range(1, TURNS):
            before, now = usage[(s, t - 1)], usage[(s, t)]
            # The previous turn's prompt (its full blocks) is a prefix of this one's, on one worker.
            assert now["prompt_tokens_details"]["cached_tokens"] >= before["prompt_tokens"] // 16 * 16, (s, t)
    stats = coord.stats()
    decisions = stats["routing"]["decisions"]
    assert stats["routing"]["policy"] == "cache-aware"
    assert decisions["prefix_hit"] >= SESSIONS * (TURNS - 1) and sum(decisions.values()) == SESSIONS * TURNS
    assert all(w["prefix_cache"]["hit_rate"] > 0 for w in stats["workers"])
    metrics = httpx.get(f"{url}/metrics").text
    want = 'fusedserve:routing_decisions_total{model_name="default",policy="cache-aware",reason="prefix_hit"}'
    assert want in metrics and "fusedserve:worker_prefix_cache_hit_tokens_total" in metrics


def test_a_session_id_is_checked_and_counted(served):
    coord, url = served
    r = httpx.post(f"{url}/v1/completions", headers={"X-Session-Id": "x" * 129},
                   json={"model": "default", "prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and "session" in r.json()["error"]["message"]
    with Client(coord.address, timeout_s=60) as c:
        with pytest.raises(ServerError) as bad:
            c.generate("Hi", max_tokens=1, session_id=7)
        assert bad.value.code == "bad_field" and "session_id" in str(bad.value)
        ok = c.generate("Hi there, a prompt of more than one block of sixteen tokens.", max_tokens=1,
                        session_id="s-1")
        again = c.generate("Hi there, a prompt of more than one block of sixteen tokens.", max_tokens=1,
                           session_id="s-1")
    assert ok["type"] == again["type"] == "done" and again["usage"]["cached_tokens"] == 16

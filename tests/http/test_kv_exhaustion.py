"""KV exhaustion: more concurrent long requests than the cache holds. Preemption (the newest request
is recomputed later) keeps every greedy output equal to the offline engine's with a cache that
never runs out, every request finishes, the preemptions are counted in ``/metrics``, and no request
takes longer than the bound stated here: the time the same requests take one after another (a
request is never starved by later ones; preempted requests go back to the front of the queue). Its
negative control: a broken block manager that reuses an evicted block without forgetting its prefix
hash (a preempted request comes back to another request's KV), and the exactness check fires."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.block_manager import BlockManager
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from tests.support import settled

# 16 blocks of 16 tokens hold 256 tokens; 6 requests of 20 + 96 tokens need 696 at once.
SERVER = dict(dtype="float32", max_batch=8, block_size=16, num_blocks=16, max_model_len=256)
PROMPTS = [[(7 * i + 3 * k) % 300 + 5 for k in range(20)] for i in range(6)]
NEW = 96


def _complete(client: httpx.Client, prompt: list[int]) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens], time.perf_counter() - t0


def _preemptions(client: httpx.Client) -> float:
    text = client.get("/metrics").text
    return float(re.search(r"^fusedserve:num_preemptions_total\{[^}]*\} (\S+)$", text, re.M).group(1))


def _want() -> list[list[int]]:
    with LLMEngine("default", dtype="float32", max_batch=8, num_blocks=256) as ref:  # never runs out
        return [o.token_ids for o in ref.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))]


def test_preemption_keeps_outputs_exact_and_every_request_within_the_bound(http):
    want = _want()
    c = http.client
    before = _preemptions(c)
    serial = sum(_complete(c, p)[1] for p in PROMPTS)  # the bound: one after another
    assert _preemptions(c) == before  # alone, a request fits: no preemption
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _complete(c, p), PROMPTS))
    assert [tokens for tokens, _ in got] == want
    assert _preemptions(c) > before  # the cache did run out
    assert max(t for _, t in got) <= 1.5 * serial, ([round(t, 2) for _, t in got], serial)
    with Client(http.coord.address) as zc:
        stats = settled(zc)
        assert all(w["kv_blocks_used"] == 0 for w in stats["workers"])
        assert stats["coordinator"]["pending"] == 0


def test_negative_control_a_stale_prefix_hash_after_eviction_is_caught(http, monkeypatch):
    want = _want()
    monkeypatch.setattr(BlockManager, "_forget", lambda self, block: None)  # evicted, still "cached"
    c = http.client
    before = _preemptions(c)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: _complete(c, p), PROMPTS))
    assert _preemptions(c) > before
    assert [tokens for tokens, _ in got] != want  # the check of the test above fires

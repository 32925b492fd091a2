"""Load: 1,000 requests from 50 concurrent clients against a `fusedserve serve` process.

Every request finishes exactly once with the offline engine's output, no KV block stays
used, and the coordinator holds nothing of any request afterwards. Its resident memory is
logged (a figure of the machine and allocator, not asserted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter

import pytest
import zmq

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from tests.serve_proc import ServeProcess
from tests.support import settled

log = logging.getLogger(__name__)

CLIENTS = 50
PER_CLIENT = 20  # 1,000 requests in all
IN_FLIGHT = 4  # per client, so ~200 requests compete for 2 x 16 batch slots
WARMUP = 4  # requests per client before the memory baseline
RC = dict(max_batch=16, block_size=16, num_blocks=256)
SERVE_ARGS = ("--workers", "2", "--dtype", "float32", "--max-batch", "16", "--block-size", "16",
              "--num-blocks", "256", "--max-requests-per-client", "8")

# 40 distinct (prompt, params): greedy and seeded sampling, lengths 3..16 tokens.
COMBOS = [(f"load {i % 20}: the quick brown fox",
           {"max_tokens": 3 + i % 14, "ignore_eos": True} if i < 20 else
           {"max_tokens": 3 + i % 14, "temperature": 0.9, "top_k": 12, "top_p": 0.95,
            "seed": 1000 + i, "ignore_eos": True})
          for i in range(40)]


@pytest.fixture(scope="module")
def reference() -> list[tuple[list[int], str]]:
    with LLMEngine("default", dtype="float32", **RC) as eng:
        outs = eng.generate([p for p, _ in COMBOS], [SamplingParams(**kw) for _, kw in COMBOS])
    return [(o.token_ids, o.text) for o in outs]


@pytest.fixture(scope="module")
def serve(ray_session, tmp_path_factory):
    proc = ServeProcess.start(tmp_path_factory.mktemp("load") / "serve.log", *SERVE_ARGS)
    yield proc
    proc.stop()


def _client_run(address: str, client_no: int, first: int, count: int,
                finals: dict[str, list[dict]], errors: list[str]) -> None:
    """Send ``count`` requests, at most IN_FLIGHT open at once; record every final frame."""
    try:
        with Client(address, timeout_s=120) as c:
            todo = [(f"c{client_no}-r{first + k}", (client_no * 7 + first + k) % len(COMBOS))
                    for k in range(count)]
            open_ids: set[str] = set()
            while todo or open_ids:
                while todo and len(open_ids) < IN_FLIGHT:
                    rid, combo = todo.pop(0)
                    prompt, params = COMBOS[combo]
                    c.send({"type": "generate", "id": rid, "prompt": prompt,
                            "stream": combo % 3 == 0, **params})
                    open_ids.add(rid)
                frame = c.recv()
                if frame["type"] in ("done", "error"):
                    finals.setdefault(frame.get("id"), []).append(frame)
                    open_ids.discard(frame.get("id"))
            # Nothing more may arrive: a second final frame for any id is a duplicate.
            c.sock.setsockopt(zmq.RCVTIMEO, 300)
            try:
                while True:
                    frame = c.recv()
                    finals.setdefault(frame.get("id"), []).append(frame)
            except TimeoutError:
                pass
    except Exception as exc:  # noqa: BLE001 - reported by the test thread
        errors.append(f"client {client_no}: {exc!r}")


def _round(address: str, first: int, count: int) -> tuple[dict[str, list[dict]], float]:
    finals: dict[str, list[dict]] = {}
    errors: list[str] = []
    threads = [threading.Thread(target=_client_run, args=(address, n, first, count, finals, errors))
               for n in range(CLIENTS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a client hung"
    return finals, time.perf_counter() - start


def _check(finals: dict[str, list[dict]], first: int, count: int, reference) -> None:
    want_ids = {f"c{n}-r{first + k}" for n in range(CLIENTS) for k in range(count)}
    assert set(finals) == want_ids, "every request has a final frame, and no stray ids"
    dup = {rid: len(f) for rid, f in finals.items() if len(f) != 1}
    assert not dup, f"requests finished more than once: {dup}"
    wrong = []
    for rid, (frame,) in finals.items():
        n, k = (int(x[1:]) for x in rid.split("-"))
        combo = (n * 7 + k) % len(COMBOS)
        if frame["type"] != "done" or (frame["token_ids"], frame["text"]) != reference[combo]:
            wrong.append((rid, combo, frame))
    assert not wrong, f"{len(wrong)} outputs differ from the offline reference: {wrong[:3]}"


def test_thousand_requests_fifty_clients(serve, reference):
    warm, warm_s = _round(serve.address, 0, WARMUP)
    _check(warm, 0, WARMUP, reference)
    with Client(serve.address) as admin:
        base = settled(admin)
    rss0 = base["coordinator"]["rss_bytes"]

    rest = PER_CLIENT - WARMUP
    finals, load_s = _round(serve.address, WARMUP, rest)
    _check(finals, WARMUP, rest, reference)
    with Client(serve.address) as admin:
        stats = settled(admin)
    total = CLIENTS * PER_CLIENT
    growth = stats["coordinator"]["rss_bytes"] - rss0
    log.warning("load: %d requests from %d clients: warm-up %.1f s, %d requests in %.1f s "
                "(%.0f req/s); coordinator rss %.1f MiB -> %+.1f MiB", total, CLIENTS, warm_s,
                CLIENTS * rest, load_s, CLIENTS * rest / load_s, rss0 / 2**20, growth / 2**20)
    assert stats["completed"] - base["completed"] == CLIENTS * rest
    assert stats["coordinator"]["pending"] == 0 and stats["coordinator"]["clients"] == 0
    assert stats["coordinator"]["orphans"] == 0 and stats["queue_length"] == 0
    assert all(w["kv_blocks_used"] == 0 for w in stats["workers"]), "every KV block is free"
    faults = stats["faults"]
    assert faults["reruns"] == 0 and faults["slow_client"] == 0 and not faults["worker_failures"]
    finish = Counter(f[0]["finish_reason"] for f in finals.values())
    assert finish == {"length": CLIENTS * rest}

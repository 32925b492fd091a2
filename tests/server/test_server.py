"""The coordinator over real ZeroMQ sockets with real Ray worker actors."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import pytest

from fusedserve.coordinator.client import Client, ServerError
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.shared_memory.arena import list_segments
from tests.support import running_server

RC = dict(max_batch=8, block_size=8, num_blocks=96, sampler_candidates=16)
# float32: its CPU kernels give each row the same bits whatever the batch, so served output
# (batched with strangers) can equal offline output exactly; bf16 oneDNN kernels do not.
DTYPE = "float32"
PROMPTS = [f"prompt {i}: the capital of France is" for i in range(6)] + ["Hello", "def hello(name):"]


def _params(i: int) -> dict:
    if i % 3 == 2:
        return {"max_tokens": 12, "temperature": 0.9, "top_k": 12, "top_p": 0.95, "seed": 100 + i,
                "ignore_eos": True}
    return {"max_tokens": 12 + i % 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference():
    with LLMEngine("default", dtype=DTYPE, **RC) as eng:
        def run(prompt: str, params: dict) -> list[int]:
            return eng.generate([prompt], SamplingParams(**params))[0].token_ids
        yield run


@pytest.fixture(scope="module", params=[(1, "auto"), (2, "auto"), (2, "serial")],
                ids=["1worker", "2workers", "2workers-serial"])
def server(request, ray_session):
    workers, transport = request.param
    with running_server(workers=workers, **RC, transport=transport, dtype=DTYPE) as coord:
        yield coord
        names = {a.name for w in coord.workers for a in w.arenas}
        assert len(names) == 2 * len(coord.workers), "two arena banks per worker (async scheduling)"
        assert names <= set(list_segments())
    assert not names & set(list_segments())


def test_served_equals_offline_under_concurrency(server, reference):
    n = 20

    def one(i: int) -> tuple[int, list[int]]:
        time.sleep(0.02 * (i % 7))  # arrivals spread while others decode
        with Client(server.address) as c:
            return i, c.generate(PROMPTS[i % len(PROMPTS)], **_params(i))["token_ids"]

    with ThreadPoolExecutor(n) as pool:
        results = dict(pool.map(one, range(n)))
    for i in range(n):
        assert results[i] == reference(PROMPTS[i % len(PROMPTS)], _params(i)), f"request {i}"
    stats = Client(server.address).stats()
    assert stats["running"] == 0 and stats["queue_length"] == 0
    for w in stats["workers"]:
        assert w["kv_blocks_used"] == 0 and w["kv_blocks_free"] == RC["num_blocks"]
    if len(server.workers) == 2:
        assert all(w["steps"] > 0 for w in stats["workers"]), "least-loaded routing used both"
    for w in stats["workers"]:  # equal outputs with the next launch sent ahead and fed on the device
        assert w["async_scheduling"] and w["launches_ahead"] > 0 and w["fed_rows"] > 0


def test_streaming_matches_non_streamed(server):
    with Client(server.address) as c:
        params = {"max_tokens": 10, "ignore_eos": True}
        done = c.generate("Once upon a time", **params)
        frames = list(c.stream("Once upon a time", **params))
    tokens = [f["token"] for f in frames if f["type"] == "token"]
    assert frames[-1]["type"] == "done"
    assert tokens == done["token_ids"] == frames[-1]["token_ids"]
    assert [f["index"] for f in frames[:-1]] == list(range(10))


def test_stream_carries_text_deltas_that_add_up_to_the_done_text(server):
    with Client(server.address) as c:
        frames = list(c.stream("Once upon a time", max_tokens=40, temperature=1.0, top_k=16, seed=5,
                               ignore_eos=True))
        stopped = list(c.stream("Once upon a time", max_tokens=40, stop=["e"], ignore_eos=True))
    tokens, done = frames[:-1], frames[-1]
    assert all(isinstance(f["text"], str) for f in tokens)
    assert "".join(f["text"] for f in tokens) == done["text"]
    if "\ufffd" not in done["text"]:
        assert not any("\ufffd" in f["text"] for f in tokens)
    streamed = "".join(f["text"] for f in stopped[:-1])
    assert streamed == stopped[-1]["text"] and "e" not in streamed


def test_abort_mid_stream_frees_blocks(server):
    with Client(server.address) as c:
        got = []
        for frame in c.stream("Numbers: 1 2 3", request_id="to-abort", max_tokens=400, ignore_eos=True):
            if frame["type"] == "token":
                got.append(frame["token"])
                if len(got) == 3:
                    c.abort("to-abort")
            else:
                assert frame["finish_reason"] == "abort"
                break
        assert 3 <= len(got) < 400
        deadline = time.time() + 10
        while time.time() < deadline:
            stats = c.stats()
            if all(w["kv_blocks_used"] == 0 for w in stats["workers"]) and stats["running"] == 0:
                break
            time.sleep(0.05)
        assert all(w["kv_blocks_used"] == 0 for w in stats["workers"])


def test_greedy_decode_d2h_is_batch_times_4(server):
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: Client(server.address).generate(PROMPTS[i], max_tokens=20, ignore_eos=True),
                      range(4)))
    stats = Client(server.address).stats()
    decoded = [w["last_decode"] for w in stats["workers"] if w["last_decode"]]
    assert decoded
    for d in decoded:
        assert d["d2h"] == d["batch"] * 4
    for w in stats["workers"]:
        assert w["transport"] == ("serial" if server.server_config.transport == "serial" else "shm")


BAD_FRAMES = [
    (b"\xc1not msgpack", "bad_frame"),
    (msgpack.packb([1, 2, 3]), "bad_frame"),
    (msgpack.packb({"type": "fly", "id": 1}), "unknown_type"),
    (msgpack.packb({"type": "generate", "id": 2, "prompt": 5}), "bad_field"),
    (msgpack.packb({"type": "generate", "id": 3, "prompt": "x", "max_tokens": "ten"}), "bad_field"),
    (msgpack.packb({"type": "generate", "id": 4, "prompt": "x", "max_tokens": -1}), "bad_param"),
    (msgpack.packb({"type": "generate", "id": 5, "prompt_ids": [1, 10**6]}), "token_out_of_range"),
    (msgpack.packb({"type": "generate", "id": 6, "prompt_ids": [1] * 5000}), "prompt_too_long"),
    (msgpack.packb({"type": "generate", "id": 7, "prompt_ids": [-4]}), "token_out_of_range"),
    (msgpack.packb({"type": "generate", "id": 8}), "bad_field"),
    (msgpack.packb({"type": "generate", "id": [1], "prompt": "x"}), "bad_field"),
    (msgpack.packb({"type": "abort", "id": 9}), "not_found"),
    (b"", "bad_frame"),
]


@pytest.mark.parametrize("frame,code", BAD_FRAMES, ids=[c + str(i) for i, (_, c) in enumerate(BAD_FRAMES)])
def test_malformed_frames_get_errors_and_server_goes_on(server, frame, code):
    with Client(server.address, timeout_s=30) as c:
        c.sock.send(frame)  # raw bytes, not a msgpack map
        reply = c.recv()
        assert reply["type"] == "error" and reply["code"] == code, reply
        assert reply["message"]
        ok = c.generate([1, 2, 3], max_tokens=2)
        assert ok["type"] == "done" and len(ok["token_ids"]) == 2


def test_duplicate_in_flight_id_is_refused(server):
    with Client(server.address) as c:
        c.send({"type": "generate", "id": "dup", "prompt": "a", "max_tokens": 50, "ignore_eos": True})
        c.send({"type": "generate", "id": "dup", "prompt": "a", "max_tokens": 5})
        replies = [c.recv(), c.recv()]
        assert {"error", "done"} == {r["type"] for r in replies}
        assert [r for r in replies if r["type"] == "error"][0]["code"] == "duplicate_id"


def test_control_requests(server):
    with Client(server.address) as c:
        assert c.health()["ok"]
        assert len(c.workers()) == len(server.workers)
        with pytest.raises(ServerError, match="no_tokenizer|not_found"):
            c._call({"type": "abort", "id": "zz", "target": "nope"})


def test_async_client_concurrent(server, reference):
    import asyncio

    from fusedserve.coordinator.client import AsyncClient

    async def main():
        ac = AsyncClient(server.address)
        try:
            outs = await asyncio.gather(*[ac.generate(PROMPTS[i], **_params(i)) for i in range(6)])
            streamed = [f async for f in ac.stream(PROMPTS[0], **_params(0))]
        finally:
            ac.close()
        return outs, streamed

    outs, streamed = asyncio.run(main())
    for i, o in enumerate(outs):
        assert o["token_ids"] == reference(PROMPTS[i], _params(i))
    assert [f["token"] for f in streamed if f["type"] == "token"] == outs[0]["token_ids"]


def test_server_thread_alive(server):
    assert server._thread is not None and server._thread.is_alive()
    assert threading.active_count() > 1

"""Clients that leave mid-request or stop reading: aborted, blocks freed, others unaffected."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from fusedserve.coordinator.client import Client
from tests.support import dealer, settled

RC = dict(max_batch=16, block_size=16, num_blocks=1200, sampler_candidates=16)


SERVER = dict(**RC, dtype="float32", max_model_len=2048, send_hwm=64, send_buffer_bytes=65536)


def _request(rid: int, stream: bool, max_tokens: int) -> bytes:
    return msgpack.packb({"type": "generate", "id": rid, "prompt_ids": [3, 1, 4, 1, 5],
                          "max_tokens": max_tokens, "ignore_eos": True, "stream": stream})


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_disconnect_aborts_and_frees_blocks(server, stream):
    with Client(server.address) as c:
        before = c.stats()
        gone_before = before["faults"]["client_gone"]
        sock = dealer(server.address)
        sock.send(_request(1, stream, 1500))
        if stream:
            for _ in range(3):
                assert msgpack.unpackb(sock.recv())["type"] == "token"
        else:
            deadline = time.time() + 30
            while c.stats()["running"] == 0 and time.time() < deadline:
                time.sleep(0.01)
        assert c.stats()["workers"][0]["kv_blocks_used"] > 0, "the request holds blocks"
        sock.close(0)
        stats = settled(c)
        assert stats["running"] == 0 and stats["coordinator"]["pending"] == 0
        assert all(w["kv_blocks_used"] == 0 for w in stats["workers"])
        assert stats["faults"]["client_gone"] == gone_before + 1, "the request ended as an abort"
        assert stats["completed"] == before["completed"], "... and never as a finished request"
        ok = c.generate([1, 2, 3], max_tokens=4)
        assert len(ok["token_ids"]) == 4


def test_slow_client_does_not_stall_others(server):
    with Client(server.address) as c:
        reference = c.generate([7, 8, 9], max_tokens=24, ignore_eos=True)["token_ids"]
        # A client that asks for 8 x 2000 streamed tokens and reads none of them: its queue
        # (SNDHWM 64, then 64 KiB of kernel send buffer) fills and the server stops owing it.
        slow = dealer(server.address, RCVHWM=1, RCVBUF=4096)
        for i in range(8):
            slow.send(_request(i, True, 2000))
        start = time.time()
        deadline = start + 120
        while c.stats()["faults"]["slow_client"] == 0 and time.time() < deadline:
            # Others are served meanwhile: a blocked loop would never answer this.
            assert c.generate([7, 8, 9], max_tokens=24, ignore_eos=True)["token_ids"] == reference
        print(f"slow client dropped after {time.time() - start:.1f} s")
        stats = settled(c)
        assert stats["faults"]["slow_client"] > 0, "the unread client was aborted"
        assert all(w["kv_blocks_used"] == 0 for w in stats["workers"])
        assert stats["coordinator"]["clients"] == 0
        # When it reads again it gets what was queued, then an error per aborted request.
        slow.setsockopt(zmq.RCVTIMEO, 5000)
        finals = {}
        try:
            while len(finals) < 8:
                msg = msgpack.unpackb(slow.recv())
                if msg["type"] not in ("token", "ping"):
                    finals[msg["id"]] = msg
        except zmq.Again:
            pass
        slow.close(0)
        codes = [m.get("code") for m in finals.values()]
        assert len(finals) == 8, "every request ended with done or error"
        assert codes.count("slow_client") == stats["faults"]["slow_client"]
        assert all(m["type"] == "done" for m in finals.values() if m.get("code") is None)

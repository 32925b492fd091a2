"""Hypothesis throws bytes, msgpack values and field mixes at the ZeroMQ front end.

Every frame must get exactly one final reply (an ``error``, a ``done`` or a control
reply, after any ``token`` frames), the server must stay up, and a valid request
after the storm must be served exactly as before it.
"""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.server.config import Limits
from fusedserve.coordinator.server.protocol import MAX_FRAME_BYTES, REQUEST_TYPES
from fusedserve.coordinator.structured.structured_spec import KINDS
from tests.support import dealer

RC = dict(max_batch=8, block_size=8, num_blocks=64, sampler_candidates=16)
FINAL = {"error", "done", "stats", "health", "workers", "scale"}
FUZZ = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck), database=None)

ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
scalars = (st.none() | st.booleans() | ints | st.floats(allow_nan=True)
           | st.text(max_size=40) | st.binary(max_size=40))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=6)
                      | st.dictionaries(st.text(max_size=10) | ints, inner, max_size=6),
                      max_leaves=24)
small_ids = st.lists(st.integers(-5, 1100), min_size=0, max_size=12)
FIELDS = {
    "type": st.sampled_from(REQUEST_TYPES) | values,
    "id": st.integers(-3, 2**64 - 1) | st.text(max_size=300) | values,
    "prompt": st.text(max_size=200) | values,
    "prompt_ids": small_ids | values,
    "max_tokens": st.integers(-2, 12) | values,
    "temperature": st.floats(-1, 200) | values,
    "top_k": st.integers(-1, 40) | values,
    "top_p": st.floats(-0.5, 1.5) | values,
    "seed": st.integers(-1, 2**64 - 1) | values,
    "stop_token_ids": small_ids | values,
    "stop": st.lists(st.text(max_size=4), max_size=3) | values,
    "ignore_eos": st.booleans() | values,
    "logprobs": st.booleans() | values,
    "stream": st.booleans() | values,
    "target": st.integers(0, 3) | values,
    "workers": st.integers(-1, 300) | values,
    # A constraint whose value JSON cannot hold (non-string keys, bytes): refused, never "internal".
    "structured": st.fixed_dictionaries({"kind": st.sampled_from(KINDS), "value": values}) | values,
}
field_mixes = st.dictionaries(st.sampled_from(sorted(FIELDS)), st.none(), max_size=len(FIELDS)).flatmap(
    lambda keys: st.fixed_dictionaries({k: FIELDS[k] for k in keys}))


SERVER = dict(**RC, dtype="float32", max_model_len=256, max_workers=1, limits=Limits(max_tokens=12))


STORM_PROBE = ("after the storm", {"max_tokens": 10, "ignore_eos": True})


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout_s=60) as c:
        c.before_storm = c.generate(STORM_PROBE[0], **STORM_PROBE[1])["token_ids"]
        yield c


def _exchange(c: Client, frames: list[bytes]) -> dict:
    """Send one message; return its final reply (tokens of a valid stream come first)."""
    c.sock.send_multipart(frames)
    while True:
        reply = c.recv()
        assert reply["type"] in FINAL | {"token"}, reply
        if reply["type"] in FINAL:
            return reply


def _check(reply: dict) -> None:
    if reply["type"] == "error":
        assert isinstance(reply["code"], str) and reply["message"], reply
        assert reply["code"] != "internal", reply  # what reached the generic handler: a bug


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes(client, blob):
    _check(_exchange(client, [blob]))


@FUZZ
@given(values)
def test_random_msgpack_values(client, value):
    _check(_exchange(client, [msgpack.packb(value, use_bin_type=True)]))


@FUZZ
@given(field_mixes, st.integers(0, 2))
def test_random_field_mixes(client, msg, extra_frames):
    frame = msgpack.packb(msg, use_bin_type=True)
    _check(_exchange(client, [b"junk"] * extra_frames + [frame]))


def test_server_intact_after_the_storm(server, client):
    # An oversize frame: libzmq drops the connection while reading the header (ZMQ_MAXMSGSIZE);
    # the socket reconnects by itself and the server serves it again.
    big = dealer(server.address)
    big.send(b"\x00" * (MAX_FRAME_BYTES + 1))
    assert not big.poll(500), "no reply to an oversize frame"
    big.close(0)
    assert server.alive()
    with Client(server.address) as fresh:
        again = fresh.generate(STORM_PROBE[0], **STORM_PROBE[1])
    assert again["token_ids"] == client.before_storm and len(again["token_ids"]) == 10
    stats = client.stats()
    assert stats["running"] == 0 and stats["coordinator"]["pending"] == 0 and stats["queue_length"] == 0
    assert all(w["kv_blocks_used"] == 0 for w in stats["workers"])
    assert len(stats["workers"]) == 1 and stats["starting"] == 0
    assert stats["faults"]["request_errors"] == 0, "no frame reached the generic handler"

"""Security: loopback by default, a token beyond it, and per-request / per-client limits."""

from __future__ import annotations

import os
import subprocess
import sys

import msgpack
import pytest

from fusedserve.coordinator.client import TOKEN_ENV, Client, ServerError
from fusedserve.coordinator.server.config import Limits, ServerConfig
from fusedserve.coordinator.server.server import Server
from tests.support import dealer, running_server

TOKEN = "s3cret-token-for-tests-0123456789"
RC = dict(max_batch=8, block_size=16, num_blocks=128)
LIMITS = Limits(max_prompt_chars=200, max_prompt_tokens=40, max_tokens=64, max_requests_per_client=2)


@pytest.fixture(scope="module")
def server(ray_session):
    """Bound on every interface, so a token is required; reached here over loopback."""
    with running_server(host="0.0.0.0", **RC, dtype="float32", auth_token=TOKEN, limits=LIMITS) as coord:
        coord.local = coord.address.replace("0.0.0.0", "127.0.0.1")
        yield coord


@pytest.fixture(autouse=True)
def _no_token_env(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def _code(address: str, prompt, token: str | None = TOKEN, **params) -> str:
    with Client(address, token=token) as c, pytest.raises(ServerError) as exc:
        c.generate(prompt, **params)
    return exc.value.code


@pytest.mark.parametrize("token", [None, "", "s3cret-token-for-tests-012345678", TOKEN + "x"],
                         ids=["missing", "empty", "one-short", "one-long"])
def test_wrong_or_missing_token_is_refused(server, token):
    with Client(server.local, token=TOKEN) as admin:
        before = admin.stats()
    with Client(server.local, token=token) as c:
        with pytest.raises(ServerError) as exc:
            c.generate("hello", max_tokens=4)
        assert exc.value.code == "unauthorized"
        with pytest.raises(ServerError) as exc:
            c.stats()
        assert exc.value.code == "unauthorized", "control requests need the token too"
    with Client(server.local, token=TOKEN) as admin:
        stats = admin.stats()
    assert stats["faults"]["unauthorized"] == before["faults"]["unauthorized"] + 2
    assert stats["tokens"] == before["tokens"], "nothing was generated for them"


def test_right_token_is_served_and_read_from_the_environment(server, monkeypatch):
    with Client(server.local, token=TOKEN) as c:
        assert len(c.generate("hello", max_tokens=4)["token_ids"]) == 4
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    with Client(server.local) as c:
        assert [f["type"] for f in c.stream("hello", max_tokens=3)] == ["token"] * 3 + ["done"]


def test_unauthorized_frame_is_not_read_further(server):
    """A bad token is refused before any other field: no parse errors leak to strangers."""
    sock = dealer(server.local, RCVTIMEO=10000)
    sock.send(msgpack.packb({"type": "nonsense", "id": 7, "max_tokens": "lots"}))
    reply = msgpack.unpackb(sock.recv())
    sock.close(0)
    assert reply["type"] == "error" and reply["code"] == "unauthorized" and reply["id"] == 7


# (refused prompt, its max_tokens, accepted prompt at the limit, its max_tokens, code)
LIMIT_CASES = [
    ("x" * 201, 4, "hi " * 13, 4, "prompt_too_long"),  # characters: checked before tokenizing
    (list(range(1, 42)), 4, list(range(1, 41)), 4, "prompt_too_long"),  # tokens
    ("hello", 65, "hello", 64, "max_tokens_too_large"),
]


@pytest.mark.parametrize("bad,bad_max,good,good_max,code", LIMIT_CASES,
                         ids=["chars", "tokens", "max_tokens"])
def test_request_limits(server, bad, bad_max, good, good_max, code):
    with Client(server.local, token=TOKEN) as c:
        with pytest.raises(ServerError) as exc:
            c.generate(bad, max_tokens=bad_max)
        assert exc.value.code == code
        assert any(str(n) in str(exc.value) for n in (200, 40, 64)), "the message names the limit"
        ok = c.generate(good, max_tokens=good_max, ignore_eos=True)
        assert len(ok["token_ids"]) == good_max


def test_requests_in_flight_per_client(server):
    with Client(server.local, token=TOKEN) as c, Client(server.local, token=TOKEN) as other:
        for rid in ("a", "b", "c"):
            c.send({"type": "generate", "id": rid, "prompt": "long", "max_tokens": 64,
                    "ignore_eos": True})
        first = c.recv()
        assert first["id"] == "c" and first["code"] == "too_many_requests", first
        assert "max_requests_per_client" in first["message"]
        # Another connection is not held back by this one's limit.
        assert len(other.generate("other", max_tokens=4)["token_ids"]) == 4
        finals = {}
        while len(finals) < 2:
            frame = c.recv()
            finals[frame["id"]] = frame["type"]
        assert finals == {"a": "done", "b": "done"}
        # With its requests finished, the connection may send again.
        assert c.generate("again", max_tokens=4)["type"] == "done"


def test_non_loopback_bind_needs_a_token():
    with pytest.raises(ValueError, match="requires an auth token"):
        Server(ServerConfig.build(workers=1, device="cpu", host="0.0.0.0", port=0)).start()
    with pytest.raises(ValueError, match="at least 16 characters"):
        Server(ServerConfig.build(workers=1, device="cpu", port=0, auth_token="short")).start()


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    return subprocess.run([sys.executable, "-m", "fusedserve.coordinator.cli", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_cli_refuses_a_public_bind_without_a_token(tmp_path):
    out = _cli("serve", "--zmq-host", "0.0.0.0", "--zmq-port", "0")  # ZeroMQ beyond loopback
    assert out.returncode == 2
    assert "refusing to bind ZeroMQ to 0.0.0.0" in out.stderr and "--auth-token-file" in out.stderr
    out = _cli("serve", "--host", "0.0.0.0", "--zmq-port", "0")  # the HTTP API beyond loopback
    assert out.returncode == 2
    assert "refusing to bind the HTTP API to 0.0.0.0" in out.stderr and "--api-key" in out.stderr
    short = tmp_path / "short"
    short.write_text("abc\n")
    out = _cli("serve", "--zmq-host", "0.0.0.0", "--auth-token-file", str(short))
    assert out.returncode == 2 and "at least 16 characters" in out.stderr


def test_cli_client_sends_the_token_file(server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    out = _cli("generate", "hello", "--max-tokens", "3", "--address", server.local,
               "--auth-token-file", str(token_file))
    assert out.returncode == 0, out.stderr
    assert out.stdout.count('"token_ids"') == 1
    out = _cli("generate", "hello", "--address", server.local)
    assert out.returncode == 1 and "unauthorized" in out.stderr


def test_cli_stream_prints_text_as_it_arrives(server, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    out = _cli("generate", "The capital of France is", "--max-tokens", "12", "--stream", "--address",
               server.local, "--auth-token-file", str(token_file))
    assert out.returncode == 0, out.stderr
    with Client(server.local, token=TOKEN) as c:
        want = c.generate("The capital of France is", max_tokens=12)
    text, _, tail = out.stdout.rstrip("\n").rpartition("\n")
    assert text == want["text"], "the streamed deltas print the request's text, not its ids"
    assert tail == f"[{want['finish_reason']}, 12 tokens]"

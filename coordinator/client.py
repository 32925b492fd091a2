"""Python clients for the coordinator: ``Client`` (sync) and ``AsyncClient`` (asyncio).

Both speak DEALER -> ROUTER with msgpack maps. A sync client is for one thread;
the async client multiplexes many requests over one socket by id.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgpack
import zmq
import zmq.asyncio

DEFAULT_ADDRESS = "tcp://127.0.0.1:5557"
TOKEN_ENV = "FUSEDSERVE_AUTH_TOKEN"


class ServerError(RuntimeError):
    def __init__(self, reply: dict):
        super().__init__(f"{reply.get('code')}: {reply.get('message')}")
        self.code = reply.get("code")
        self.reply = reply


# Frames that change or reveal the deployment: they carry the admin token ("admin"), not just "auth".
ADMIN_TYPES = ("scale", "workers", "load_lora", "unload_lora")
# The longest end-client name or session id a generate frame may carry.
MAX_CLIENT_CHARS = 128


def _generate_msg(rid: Any, prompt: str | list[int], stream: bool, params: dict) -> dict:
    msg = {"type": "generate", "id": rid, "stream": stream, **params}
    msg["prompt" if isinstance(prompt, str) else "prompt_ids"] = prompt
    return msg


def _token(token: str | None) -> str | None:
    return token if token is not None else os.environ.get(TOKEN_ENV) or None


def _secure(sock: zmq.Socket, server_key: str | bytes | None) -> None:
    """CURVE encryption to a server whose public key is ``server_key`` (z85), with a fresh key pair
    of this client's own (the server authenticates clients by their token, not their key)."""
    if server_key is None:
        return
    public, secret = zmq.curve_keypair()
    sock.curve_publickey, sock.curve_secretkey = public, secret
    sock.curve_serverkey = server_key.encode() if isinstance(server_key, str) else server_key


class Client:
    """``token``: the server's auth token (default: $FUSEDSERVE_AUTH_TOKEN), sent on every frame;
    ``admin_token``: sent on admin frames (``scale``, ``workers``); ``curve_server_key``: the
    server's CURVE public key, where it encrypts its socket."""

    def __init__(self, address: str = DEFAULT_ADDRESS, timeout_s: float = 120.0,
                 token: str | None = None, admin_token: str | None = None,
                 curve_server_key: str | bytes | None = None):
        self.token = _token(token)
        self.admin_token = admin_token
        self._ctx = zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
        _secure(self.sock, curve_server_key)
        self.sock.connect(address)
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    def _next_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def send(self, msg: dict) -> None:
        if self.token is not None:
            msg = {**msg, "auth": self.token}
        if self.admin_token is not None and msg.get("type") in ADMIN_TYPES:
            msg = {**msg, "admin": self.admin_token}
        self.sock.send(msgpack.packb(msg, use_bin_type=True))

    def recv(self) -> dict:
        """The next reply; the server's liveness ``ping`` frames are skipped."""
        while True:
            try:
                reply = msgpack.unpackb(self.sock.recv(), raw=False)
            except zmq.Again:
                raise TimeoutError("no reply from the coordinator in time") from None
            if reply.get("type") != "ping":
                return reply

    def _call(self, msg: dict) -> dict:
        self.send(msg)
        while True:
            reply = self.recv()
            if reply.get("id") == msg["id"] or (reply.get("id") is None and reply["type"] == "error"):
                if reply["type"] == "error":
                    raise ServerError(reply)
                return reply

    def generate(self, prompt: str | list[int], **params: Any) -> dict:
        """Send a request and wait for its ``done`` reply."""
        return self._call(_generate_msg(self._next_id(), prompt, False, params))

    def stream(self, prompt: str | list[int], request_id: str | None = None,
               **params: Any) -> Iterator[dict]:
        """Yield ``token`` frames, then the ``done`` frame."""
        rid = request_id or self._next_id()
        self.send(_generate_msg(rid, prompt, True, params))
        while True:
            reply = self.recv()
            if reply.get("id") != rid:
                continue
            if reply["type"] == "error":
                raise ServerError(reply)
            yield reply
            if reply["type"] == "done":
                return

    def abort(self, request_id: str) -> None:
        self.send({"type": "abort", "id": request_id})

    def stats(self) -> dict:
        return self._call({"type": "stats", "id": self._next_id()})

    def health(self) -> dict:
        return self._call({"type": "health", "id": self._next_id()})

    def scale(self, workers: int) -> dict:
        """Ask for ``workers`` workers: new ones start in the background, removed ones drain."""
        return self._call({"type": "scale", "id": self._next_id(), "workers": workers})

    def workers(self) -> list[dict]:
        return self._call({"type": "workers", "id": self._next_id()})["workers"]

    def loras(self) -> list[dict]:
        """The LoRA adapters requests may name (``lora=``), each with its parent model."""
        return self._call({"type": "loras", "id": self._next_id()})["adapters"]

    def load_lora(self, name: str, path: str) -> list[dict]:
        """Serve the PEFT adapter in ``path`` (on the workers' filesystem) as ``name`` (admin)."""
        msg = {"type": "load_lora", "id": self._next_id(), "name": name, "path": path}
        return self._call(msg)["adapters"]

    def unload_lora(self, name: str) -> list[dict]:
        return self._call({"type": "unload_lora", "id": self._next_id(), "name": name})["adapters"]

    def close(self) -> None:
        self.sock.close(0)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """Many concurrent requests over one socket; a reader task routes replies by id."""

    def __init__(self, address: str = DEFAULT_ADDRESS, token: str | None = None,
                 curve_server_key: str | bytes | None = None, admin_token: str | None = None):
        self.token = _token(token)
        self.admin_token = admin_token  # sent on admin frames (``ADMIN_TYPES``)
        self._ctx = zmq.asyncio.Context.instance()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        _secure(self.sock, curve_server_key)
        self.sock.connect(address)
        self._queues: dict[Any, asyncio.Queue] = {}
        # generate requests in flight, and how many per end client (the gateway sheds on these
        # before a coordinator round trip)
        self._owners: dict[Any, str | None] = {}
        self.per_client: collections.Counter = collections.Counter()
        self._reader: asyncio.Task | None = None
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    async def _read(self) -> None:
        while True:
            reply = msgpack.unpackb(await self.sock.recv(), raw=False)
            if reply.get("type") == "ping":
                continue
            q = self._queues.get(reply.get("id"))
            if q is not None:
                q.put_nowait(reply)

    async def _open(self, rid: Any, msg: dict) -> asyncio.Queue:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = q
        if msg.get("type") == "generate":
            self._owners[rid] = msg.get("client")
            self.per_client[msg.get("client")] += 1
        await self._send(msg)
        return q

    def _close(self, rid: Any) -> None:
        self._queues.pop(rid, None)
        if rid in self._owners:
            owner = self._owners.pop(rid)
            self.per_client[owner] -= 1
            if self.per_client[owner] <= 0:
                del self.per_client[owner]

    @property
    def in_flight(self) -> int:
        """generate requests sent and not yet done."""
        return len(self._owners)

    async def _send(self, msg: dict) -> None:
        if self.token is not None:
            msg = {**msg, "auth": self.token}
        if self.admin_token is not None and msg.get("type") in ADMIN_TYPES:
            msg = {**msg, "admin": self.admin_token}
        await self.sock.send(msgpack.packb(msg, use_bin_type=True))

    def new_id(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    async def stream(self, prompt: str | list[int], request_id: str | None = None,
                     **params: Any) -> AsyncIterator[dict]:
        """``token`` frames, then the ``done`` frame; ``request_id`` lets the caller abort it."""
        rid = request_id or self.new_id()
        q = await self._open(rid, _generate_msg(rid, prompt, True, params))
        try:
            while True:
                reply = await q.get()
                if reply["type"] == "error":
                    raise ServerError(reply)
                yield reply
                if reply["type"] == "done":
                    return
        finally:
            self._close(rid)

    async def generate(self, prompt: str | list[int], request_id: str | None = None, **params: Any) -> dict:
        rid = request_id or self.new_id()
        return await self._call(rid, _generate_msg(rid, prompt, False, params))

    async def abort(self, request_id: str) -> None:
        """Stop a request in flight (its KV blocks are freed); a finished one is not found."""
        await self._send({"type": "abort", "id": f"{request_id}:abort", "target": request_id})

    async def stats(self) -> dict:
        rid = self.new_id()
        return await self._call(rid, {"type": "stats", "id": rid})

    async def health(self) -> dict:
        rid = self.new_id()
        return await self._call(rid, {"type": "health", "id": rid})

    async def control(self, kind: str, **fields: Any) -> dict:
        """A control frame of type ``kind`` (``loras``, ``load_lora``, ...) and its reply."""
        rid = self.new_id()
        return await self._call(rid, {"type": kind, "id": rid, **fields})

    async def _call(self, rid: str, msg: dict) -> dict:
        q = await self._open(rid, msg)
        try:
            reply = await q.get()
        finally:
            self._close(rid)
        if reply["type"] == "error":
            raise ServerError(reply)
        return reply

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self.sock.close(0)

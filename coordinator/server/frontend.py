"""The client-facing ROUTER socket: bounded, non-blocking delivery and peer-loss detection.

A send never blocks the loop. ``ROUTER_MANDATORY`` turns what a plain ROUTER would
do silently into answers: a peer that has gone makes the send fail with EHOSTUNREACH
(``GONE``), a peer whose queue is at the high-water mark with EAGAIN (``FULL``). The
coordinator aborts the requests of both, so their KV blocks come back at once.

ROUTER sockets do not say which peer left. The socket monitor says that *some* peer
did; the coordinator then probes every peer with requests in flight with a ``ping``
frame (no id, which clients ignore) for a short while, and those that are gone fail
the send. Streaming peers are found on their next token without a probe.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from fusedserve.coordinator.server import protocol

log = logging.getLogger(__name__)

PING = protocol.pack({"type": "ping"})
PROBE_WINDOW_S = 1.0  # libzmq may report a disconnect before the ROUTER drops the peer
PROBE_EVERY_S = 0.1
LAST_WORDS_S = 10.0
# ZMTP heartbeats drop peers that vanished without closing TCP (a cable, a frozen host).
# A peer that stops reading also stops answering them, so the timeout is kept well above
# the time a stalled reader takes to fill its queue: that peer is found by FULL instead.
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 30000


class Delivery(enum.Enum):
    OK = "ok"
    GONE = "gone"  # the peer disconnected
    FULL = "full"  # the peer's send queue is at the high-water mark


@dataclass
class _LastWords:
    frames: list[bytes]
    deadline: float


@dataclass
class Frontend:
    """The bound ROUTER socket, its monitor and the final errors still owed to slow peers."""

    sock: zmq.Socket
    monitor: zmq.Socket
    address: str
    _probe_until: float = 0.0
    _next_probe: float = 0.0
    _last_words: dict[bytes, _LastWords] = field(default_factory=dict)
    disconnects: int = 0

    @classmethod
    def bind(cls, ctx: zmq.Context, host: str, port: int, send_hwm: int,
             send_buffer_bytes: int = 0, curve_secret_key: str | None = None) -> Frontend:
        """Bind the ROUTER; ``send_buffer_bytes`` > 0 caps each peer's kernel send buffer;
        ``curve_secret_key`` (z85) encrypts every connection with CURVE."""
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if curve_secret_key is not None:
            sock.curve_secretkey = curve_secret_key.encode()
            sock.curve_server = True
        # Oversize frames are refused by libzmq while reading the header: the peer is
        # disconnected and the body is never buffered.
        sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, send_hwm)
        if send_buffer_bytes > 0:
            sock.setsockopt(zmq.SNDBUF, send_buffer_bytes)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        if port == 0:
            port = sock.bind_to_random_port(f"tcp://{host}")
        else:
            sock.bind(f"tcp://{host}:{port}")
        return cls(sock, monitor, f"tcp://{host}:{port}")

    def recv(self) -> tuple[bytes, bytes] | None:
        """One client frame as (identity, last frame), or None when none is queued."""
        try:
            identity, *frames = self.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return None
        return identity, frames[-1] if frames else b""

    def send(self, identity: bytes, msg: dict) -> Delivery:
        return self.send_frame(identity, protocol.pack(msg))

    def send_frame(self, identity: bytes, frame: bytes) -> Delivery:
        try:
            self.sock.send_multipart([identity, frame], zmq.NOBLOCK)
            return Delivery.OK
        except zmq.Again:
            return Delivery.FULL
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                return Delivery.GONE
            raise

    def owe(self, identity: bytes, msg: dict) -> None:
        """Deliver ``msg`` when the peer's queue has room again, for at most LAST_WORDS_S."""
        entry = self._last_words.setdefault(identity, _LastWords([], time.monotonic() + LAST_WORDS_S))
        entry.frames.append(protocol.pack(msg))

    def flush_owed(self) -> None:
        now = time.monotonic()
        for identity, entry in list(self._last_words.items()):
            result = Delivery.OK
            while entry.frames:
                result = self.send_frame(identity, entry.frames[0])
                if result is not Delivery.OK:
                    break
                entry.frames.pop(0)
            if not entry.frames or result is Delivery.GONE or now > entry.deadline:
                del self._last_words[identity]

    @property
    def owed(self) -> int:
        return sum(len(e.frames) for e in self._last_words.values())

    def peer_left(self) -> bool:
        """Drain monitor events; True when a peer disconnected since the last call."""
        left = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                left = True
        if left:
            self.disconnects += 1
            self._probe_until = time.monotonic() + PROBE_WINDOW_S
            self._next_probe = 0.0
        return left

    def probe(self, identities: set[bytes]) -> set[bytes]:
        """Identities among ``identities`` that are gone (only while a disconnect is fresh)."""
        now = time.monotonic()
        if not identities or now > self._probe_until or now < self._next_probe:
            return set()
        self._next_probe = now + PROBE_EVERY_S
        return {i for i in identities if self.send_frame(i, PING) is Delivery.GONE}

    def close(self, linger_ms: int) -> None:
        """Close, giving queued replies (the shutdown errors) ``linger_ms`` to leave."""
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.setsockopt(zmq.LINGER, linger_ms)
        self.sock.close()

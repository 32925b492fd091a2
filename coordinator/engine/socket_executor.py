"""A launch over a Ray worker's step socket (PAIR): the descriptor out, the reply back."""

from __future__ import annotations

import logging
from collections import deque

import msgpack
import zmq

from fusedserve.coordinator.engine.executor import WorkerGone
from fusedserve.shared_memory import transport
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.contract import LaunchDescriptor, LaunchReply
from fusedserve.shared_memory.slots import step_table

log = logging.getLogger(__name__)


class SocketExecutor:
    """A Ray worker's PAIR socket. Shared memory: the message is the descriptor alone.
    Serial (a worker on another node, or forced): it also carries the HOST_SHARED
    input bytes, and the reply the output bytes, which land in the local arena bank.
    The worker answers launches in the order they were sent.

    ``epoch`` names the worker incarnation this socket reaches. Every descriptor carries it and
    every reply must echo it and the step of the oldest launch in flight: any other frame (from
    an incarnation that was replaced, or answering a launch that is no longer owed) is fenced,
    dropped and counted, never read into the arena.
    """

    def __init__(self, sock: zmq.Socket, arenas: list[HostArena], serial: bool, epoch: int = 0):
        self.sock = sock
        self.arenas = arenas
        self.serial = serial
        self.epoch = epoch
        self.table = step_table()
        self.wire_bytes = 0
        self.fenced = 0  # frames refused: another incarnation's, or for a launch not owed
        self._sent: deque[LaunchDescriptor] = deque()
        self._reply: LaunchReply | None = None  # the oldest launch's reply, received and checked

    def submit(self, desc: LaunchDescriptor) -> None:
        msg = desc.to_wire()
        msg["epoch"] = self.epoch  # stamped on the wire: the queued descriptor keeps only its step
        if self.serial:
            msg["inputs"] = transport.pack_inputs(self.arenas[desc.bank], self.table, desc.dims)
        payload = msgpack.packb(msg)
        try:
            self.sock.send(payload, zmq.NOBLOCK)  # PAIR with no peer would block: the worker is gone
        except zmq.Again:
            raise WorkerGone("step socket has no peer") from None
        self.wire_bytes += len(payload)
        self._sent.append(desc)

    def ready(self, poll_events: dict) -> bool:
        """True when the oldest launch's reply is here (``poll_events``: the loop's poll result)."""
        if self._reply is None and self._sent and self.sock in poll_events:
            while self._reply is None and self.sock.poll(0):
                self._reply = self._accept(self.sock.recv())
        return self._reply is not None

    def wait(self) -> LaunchReply:
        while self._reply is None:
            self._reply = self._accept(self.sock.recv())
        reply, self._reply = self._reply, None
        desc = self._sent.popleft()
        if self.serial and reply.ok:
            transport.unpack(self.arenas[desc.bank], self.table, desc.dims, reply.outputs or {},
                             outputs=True)
        return reply

    def _accept(self, raw: bytes) -> LaunchReply | None:
        """The reply, if it answers the oldest launch of this incarnation; else None (fenced)."""
        self.wire_bytes += len(raw)
        reply = LaunchReply.from_wire(msgpack.unpackb(raw, raw=False))
        owed = self._sent[0] if self._sent else None
        if owed is not None and reply.epoch == self.epoch and reply.step == owed.step:
            return reply
        self.fenced += 1
        log.warning("fenced a reply of incarnation %d for step %d (owed: incarnation %d, step %s)",
                    reply.epoch, reply.step, self.epoch, None if owed is None else owed.step)
        return None

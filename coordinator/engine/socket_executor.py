"""A launch over a Ray worker's step socket (PAIR): the descriptor out, the reply back."""

from __future__ import annotations

from collections import deque

import msgpack
import zmq

from fusedserve.coordinator.engine.executor import WorkerGone
from fusedserve.shared_memory import transport
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.contract import LaunchDescriptor, LaunchReply
from fusedserve.shared_memory.slots import step_table


class SocketExecutor:
    """A Ray worker's PAIR socket. Shared memory: the message is the descriptor alone.
    Serial (a worker on another node, or forced): it also carries the HOST_SHARED
    input bytes, and the reply the output bytes, which land in the local arena bank.
    The worker answers launches in the order they were sent."""

    def __init__(self, sock: zmq.Socket, arenas: list[HostArena], serial: bool):
        self.sock = sock
        self.arenas = arenas
        self.serial = serial
        self.table = step_table()
        self.wire_bytes = 0
        self._sent: deque[LaunchDescriptor] = deque()

    def submit(self, desc: LaunchDescriptor) -> None:
        msg = desc.to_wire()
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
        """True when a reply is waiting (``poll_events``: the loop's poll result)."""
        return bool(self._sent) and self.sock in poll_events

    def wait(self) -> LaunchReply:
        raw = self.sock.recv()
        self.wire_bytes += len(raw)
        reply = LaunchReply.from_wire(msgpack.unpackb(raw, raw=False))
        desc = self._sent.popleft() if self._sent else None
        if self.serial and reply.ok and desc is not None:
            transport.unpack(self.arenas[desc.bank], self.table, desc.dims, reply.outputs or {},
                             outputs=True)
        return reply

"""How a launch reaches a device: in this process, or over a worker's step socket.

An executor takes a ``LaunchDescriptor`` whose inputs are already in the arena and
hands back a ``LaunchReply`` once the outputs are there too. ``EngineCore`` does not
know which one it has: that is the whole point of the split (vLLM V1's executor).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import msgpack
import zmq

from shared_memory import transport
from shared_memory.arena import HostArena
from shared_memory.contract import LaunchDescriptor, LaunchReply
from shared_memory.slots import step_table


class WorkerGone(RuntimeError):
    """The step socket has no peer: the worker process is gone."""


class Runner(Protocol):
    """What the in-process executor drives (``worker.model_runner.ModelRunner``)."""

    def execute(self, desc: LaunchDescriptor) -> LaunchReply: ...


class Executor(Protocol):
    def submit(self, desc: LaunchDescriptor) -> None: ...

    def wait(self) -> LaunchReply: ...


class InProcessExecutor:
    """Runs each launch at once on a model runner in this process (the offline engine);
    ``wait`` hands the replies back in launch order.

    A failing launch raises here, to the caller, with its traceback.
    """

    def __init__(self, runner: Runner):
        self.runner = runner
        self._replies: deque[LaunchReply] = deque()

    def submit(self, desc: LaunchDescriptor) -> None:
        self._replies.append(self.runner.execute(desc))

    def wait(self) -> LaunchReply:
        if not self._replies:
            raise RuntimeError("wait() without a submitted launch")
        return self._replies.popleft()


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

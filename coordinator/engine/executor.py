"""How a launch reaches a device: in this process, or over a worker's step socket.

An executor takes a ``LaunchDescriptor`` whose inputs are already in the arena and
hands back a ``LaunchReply`` once the outputs are there too. ``EngineCore`` does not
know which one it has: that is the whole point of the split (vLLM V1's executor). The
socket one, with its ZeroMQ and msgpack, is ``socket_executor.py``: the offline engine does
without either.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from fusedserve.shared_memory.contract import LaunchDescriptor, LaunchReply


class WorkerGone(RuntimeError):
    """The step socket has no peer: the worker process is gone."""


class Runner(Protocol):
    """What the in-process executor drives (``fusedserve.worker.model_runner.ModelRunner``)."""

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

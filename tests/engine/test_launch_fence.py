"""The step socket's fence: a reply counts only if it answers the oldest launch in flight of the
worker incarnation the socket reaches. Anything else (a replaced incarnation's late frame, a
reply to a launch no longer owed) is dropped and counted, never read as the launch's outputs."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from fusedserve.coordinator.engine.socket_executor import SocketExecutor
from fusedserve.shared_memory.contract import LaunchDescriptor, LaunchReply


@pytest.fixture
def pair():
    ctx = zmq.Context()
    coordinator, worker = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = worker.bind_to_random_port("tcp://127.0.0.1")  # as in the server: the worker binds
    coordinator.connect(f"tcp://127.0.0.1:{port}")
    yield coordinator, worker
    coordinator.close(0)
    worker.close(0)
    ctx.term()


def _reply(worker: zmq.Socket, **kw) -> None:
    worker.send(msgpack.packb(LaunchReply(True, **kw).to_wire()))


def _until(pred, what: str) -> None:
    deadline = time.time() + 10
    while not pred():
        assert time.time() < deadline, what
        time.sleep(0.01)


def test_only_the_owed_reply_of_this_incarnation_is_accepted(pair):
    coordinator, worker = pair
    ex = SocketExecutor(coordinator, [], serial=False, epoch=7)
    ex.submit(LaunchDescriptor({"B": 1, "T": 1}, step=5, bank=0))
    sent = msgpack.unpackb(worker.recv(), raw=False)
    assert sent["epoch"] == 7 and sent["step"] == 5  # every descriptor names its incarnation
    ready = {coordinator: zmq.POLLIN}
    _reply(worker, epoch=6, step=5, d2h=111)  # the incarnation this one replaced
    _reply(worker, epoch=7, step=4, d2h=222)  # a launch of this incarnation no longer owed
    _until(lambda: ex.ready(ready) or ex.fenced == 2, "both stale frames to arrive")
    assert ex.fenced == 2 and not ex.ready(ready)
    _reply(worker, epoch=7, step=5, d2h=4)
    _until(lambda: ex.ready(ready), "the owed reply")
    reply = ex.wait()
    assert (reply.epoch, reply.step, reply.d2h) == (7, 5, 4) and ex.fenced == 2


def test_a_late_duplicate_is_fenced_by_the_blocking_wait_too(pair):
    coordinator, worker = pair
    ex = SocketExecutor(coordinator, [], serial=False, epoch=3)
    _reply(worker, epoch=3, step=0)  # nothing was sent: a duplicate, never a launch's outputs
    coordinator.poll(5000)
    assert not ex.ready({coordinator: zmq.POLLIN})  # nothing owed: not even read
    ex.submit(LaunchDescriptor({"B": 1, "T": 1}, step=1, bank=0))
    worker.recv()
    _reply(worker, epoch=3, step=1, d2h=8)
    reply = ex.wait()  # reads the duplicate first: fenced, then the owed reply
    assert (reply.step, reply.d2h, ex.fenced) == (1, 8, 1)

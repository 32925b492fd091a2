"""Helpers shared by the tests that talk to a server or wait on other processes."""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq

from coordinator.client import Client


def wait_for(pred: Callable[[], object], timeout_s: float, what: str, every_s: float = 0.005) -> None:
    """Poll ``pred`` until it is truthy; fail naming ``what`` after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if pred():
            return
        time.sleep(every_s)
    raise AssertionError(f"timed out waiting for {what}")


def settled(c: Client, timeout_s: float = 30) -> dict:
    """The server's stats once nothing runs, waits, is pending or is in a launch, and every KV
    block is free."""
    box: dict = {}

    def idle() -> bool:
        box["stats"] = s = c.stats()
        return (s["running"] == 0 and s["queue_length"] == 0 and s["coordinator"]["pending"] == 0
                and all(w["kv_blocks_used"] == 0 and not w["launch_in_flight"] for w in s["workers"]))

    wait_for(idle, timeout_s, "the server to go idle", every_s=0.05)
    return box["stats"]


def dealer(address: str, **opts: int) -> zmq.Socket:
    """A bare DEALER socket (``opts``: zmq option names to values), for raw frames."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    for name, value in opts.items():
        sock.setsockopt(getattr(zmq, name), value)
    sock.connect(address)
    return sock

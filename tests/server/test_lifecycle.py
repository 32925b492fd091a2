"""Coordinator process lifecycle: SIGTERM drains cleanly; a SIGKILL's leftovers are swept.

SIGTERM: requests in flight end with a ``shutdown`` error (or finish), the workers stop,
the process exits 0 and every shared-memory segment it created is unlinked. SIGKILL: no
handler runs, so its segments stay; Ray kills the workers it owned, and the next
coordinator to start removes the segments of owners that no longer exist.
"""

from __future__ import annotations

import signal

import msgpack
import zmq

from fusedserve.coordinator.client import Client
from fusedserve.shared_memory.arena import list_segments, pid_alive
from tests.serve_proc import ServeProcess
from tests.support import dealer, wait_for

ARGS = ("--workers", "2", "--dtype", "float32", "--max-model-len", "1024")


def _owned(pid: int) -> list[str]:
    return [s for s in list_segments() if s.startswith(f"fusedserve_{pid}_")]


def _worker_pids(address: str) -> list[int]:
    with Client(address) as c:
        return [w["pid"] for w in c.workers()]


def _stream(address: str, rid: str, stream: bool) -> zmq.Socket:
    sock = dealer(address, RCVTIMEO=30000)
    sock.send(msgpack.packb({"type": "generate", "id": rid, "prompt": "a long story",
                             "max_tokens": 900, "ignore_eos": True, "stream": stream}))
    return sock


def _recv(sock: zmq.Socket) -> dict:
    """The next frame that is not a liveness ping."""
    while True:
        msg = msgpack.unpackb(sock.recv())
        if msg["type"] != "ping":
            return msg


def _final(sock: zmq.Socket) -> dict:
    """Read until this request's final frame (done or error)."""
    while True:
        msg = _recv(sock)
        if msg["type"] in ("done", "error"):
            return msg


def test_sigterm_mid_stream_drains_and_unlinks(ray_session, tmp_path):
    serve = ServeProcess.start(tmp_path / "serve.log", *ARGS)
    try:
        pid = serve.proc.pid
        workers = _worker_pids(serve.address)
        assert len(workers) == 2 and _owned(pid), "two workers and their argument arenas"
        streaming = _stream(serve.address, "s", True)
        for _ in range(5):
            assert _recv(streaming)["type"] == "token"
        waiting = _stream(serve.address, "n", False)
        with Client(serve.address) as c:
            wait_for(lambda: c.stats()["running"] == 2, 30, "both requests to run")
        serve.signal(signal.SIGTERM)
        for sock, rid in ((streaming, "s"), (waiting, "n")):
            final = _final(sock)
            sock.close(0)
            assert final["id"] == rid
            assert final["type"] == "done" or final["code"] == "shutdown", final
        assert serve.wait() == 0, serve.log_path.read_text()[-3000:]
        assert "shutting down" in "".join(serve.lines)
        assert _owned(pid) == [], "every segment the coordinator created is unlinked"
        wait_for(lambda: not any(pid_alive(w) for w in workers), 30, "the workers to exit")
    finally:
        serve.stop()


def test_sigkill_leaves_segments_that_the_next_start_removes(ray_session, tmp_path):
    """The fallback behind the watchdog (tests/server/test_network_exposure.py): with it off, or
    killed too, the segments of a SIGKILLed server stay until the next start removes them."""
    first = ServeProcess.start(tmp_path / "first.log", *ARGS, env={"FUSEDSERVE_HEAD_REAPER": "0"})
    try:
        pid = first.proc.pid
        workers = _worker_pids(first.address)
        left = _owned(pid)
        assert len(left) >= 2, "one argument arena per worker"
        first.signal(signal.SIGKILL)
        assert first.wait() == -signal.SIGKILL
        # Ray kills the actors a dead driver owned; the segments have no one to unlink them.
        wait_for(lambda: not any(pid_alive(w) for w in workers), 60, "the orphaned workers to die")
        assert _owned(pid) == left, "a SIGKILLed coordinator without its watchdog cannot clean up"
    finally:
        first.stop()
    second = ServeProcess.start(tmp_path / "second.log", *ARGS)
    try:
        assert _owned(pid) == [], "the next start removed the dead owner's segments"
        assert "stale shared-memory segments" in second.log_path.read_text()
        with Client(second.address) as c:
            assert len(c.generate("after a crash", max_tokens=4)["token_ids"]) == 4
        assert _owned(second.proc.pid), "the new coordinator's own arenas exist"
    finally:
        second.stop()
    assert second.proc.returncode == 0
    assert _owned(second.proc.pid) == []

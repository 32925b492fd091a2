"""What `fusedserve serve` exposes and leaves behind, counted by session (Ray's agents are reparented
to init and ignore SIGTERM, so parentage misses them): with its own embedded Ray head, no process of
it listens beyond loopback, and SIGTERM or SIGINT ends every one of them."""

from __future__ import annotations

import ipaddress
import os
import re
import signal

import pytest

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.server.ray_cluster import session_pids
from tests.serve_proc import ServeProcess
from tests.support import listening_sockets, wait_for

HEAD = re.compile(r"embedded Ray head at \S+ \(session (\d+)\)")


def _kill_sessions(sessions: set[int]) -> None:
    for s in sessions:
        for pid in session_pids(s):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_serve_listens_on_loopback_only_and_leaves_no_process(tmp_path, sig):
    serve = ServeProcess.start(tmp_path / "serve.log", "--workers", "1", "--dtype", "float32",
                               "--http-port", "0", join_session=False, new_session=True)
    sessions = {serve.proc.pid}  # serve leads its own session
    try:
        m = HEAD.search("".join(serve.lines))
        assert m, serve.lines
        sessions.add(int(m.group(1)))
        with Client(serve.address) as c:  # the worker is up and has run a request
            assert len(c.generate("hello", max_tokens=4)["token_ids"]) == 4
        pids = [p for s in sessions for p in session_pids(s)]
        assert len(pids) >= 6, "serve, the GCS, the raylet, the agents and a worker"
        sockets = listening_sockets(pids)
        assert sockets, "the check sees the listening sockets"
        beyond = [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback]
        assert beyond == [], beyond
        serve.signal(sig)
        assert serve.wait() == 0, serve.log_path.read_text()[-3000:]
        wait_for(lambda: not any(session_pids(s) for s in sessions), 30,
                 "every process of serve and of its Ray head to end")
    finally:
        serve.stop()
        _kill_sessions(sessions)

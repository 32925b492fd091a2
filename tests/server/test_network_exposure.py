"""What `fusedserve serve` exposes and leaves behind, counted by session (Ray's agents are reparented
to init and ignore SIGTERM, so parentage misses them): with its own embedded Ray head, no process of
it listens beyond loopback, SIGTERM or SIGINT ends every one of them, and so does SIGKILL (through
its head's watchdog)."""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import time
from pathlib import Path

import pytest

from fusedserve.coordinator.client import Client, ServerError
from fusedserve.coordinator.server.ray_cluster import session_pids
from fusedserve.shared_memory.arena import PREFIX, SHM_DIR
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


def _reapers(parent: int) -> list[int]:
    """The watchdog processes of the server ``parent`` (by their command lines)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0") if d.name.isdigit() else []
        except OSError:
            continue
        if b"fusedserve.coordinator.server.head_reaper" in cmd and str(parent).encode() in cmd:
            found.append(int(d.name))
    return found


def _segments(pid: int) -> list[Path]:
    return list(SHM_DIR.glob(f"{PREFIX}_{pid}_*"))


@pytest.mark.parametrize("reaper", [True, False], ids=["reaped", "negative-control"])
def test_a_killed_server_leaves_nothing_behind(tmp_path, reaper):
    """SIGKILL of `serve` mid-stream: its head's watchdog ends every process of the head (workers
    included) and unlinks the server's segments within 30 s; a client gets an error, not a hang.
    Without the watchdog (FUSEDSERVE_HEAD_REAPER=0) the same check finds them still there."""
    env = None if reaper else {"FUSEDSERVE_HEAD_REAPER": "0"}
    serve = ServeProcess.start(tmp_path / "serve.log", "--workers", "1", "--dtype", "float32",
                               join_session=False, new_session=True, env=env)
    pid, head = serve.proc.pid, None
    try:
        m = HEAD.search("".join(serve.lines))
        assert m, serve.lines
        head = int(m.group(1))
        with Client(serve.address, timeout_s=5) as c:
            stream = c.stream("The with statement", max_tokens=2000, ignore_eos=True)
            assert next(stream)["type"] == "token"
            assert _segments(pid) and len(session_pids(head)) >= 4
            assert bool(_reapers(pid)) == reaper
            t0 = time.monotonic()
            serve.signal(signal.SIGKILL)
            serve.proc.wait()  # reaped at once, as a shell reaps its job
            with pytest.raises((TimeoutError, ServerError)):  # no hang: the client's timeout ends it
                for _ in stream:
                    pass
        if not reaper:
            time.sleep(10)
            assert session_pids(head) and _segments(pid), "the check fires without the watchdog"
            return
        wait_for(lambda: not session_pids(head) and not _segments(pid) and not _reapers(pid), 30,
                 "the head's processes, the segments and the watchdog to be gone")
        print(f"killed server cleaned up in {time.monotonic() - t0:.1f} s")
    finally:
        serve.stop()
        if head is not None:
            _kill_sessions({head})
        for seg in _segments(pid):
            seg.unlink(missing_ok=True)


@pytest.mark.parametrize("reaper", [True, False], ids=["reaped", "negative-control"])
def test_a_killed_server_in_a_joined_cluster_leaves_no_segment(ray_session, tmp_path, reaper):
    """`serve --ray-address ...` SIGKILLed: its actors die with their owner (Ray's rule) and its
    watchdog unlinks the segments the workers held, within 30 s; without it they stay."""
    env = None if reaper else {"FUSEDSERVE_HEAD_REAPER": "0"}
    serve = ServeProcess.start(tmp_path / "serve.log", "--workers", "1", "--dtype", "float32", env=env)
    pid = serve.proc.pid
    try:
        with Client(serve.address, timeout_s=5) as c:
            assert len(c.generate("hello", max_tokens=3)["token_ids"]) == 3
        assert _segments(pid) and bool(_reapers(pid)) == reaper
        serve.signal(signal.SIGKILL)
        serve.proc.wait()
        if not reaper:
            time.sleep(15)
            assert _segments(pid), "the check fires without the watchdog"
            return
        wait_for(lambda: not _segments(pid) and not _reapers(pid), 30, "the segments and the watchdog to go")
    finally:
        serve.stop()
        for seg in _segments(pid):
            seg.unlink(missing_ok=True)

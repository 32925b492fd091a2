"""Embedded Ray heads: two servers on one machine, each with a head of its own, do not
collide on Ray's fixed agent ports, and each head goes away with its server."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.server.ray_cluster import EmbeddedHead, RayPorts
from tests.serve_proc import ServeProcess
from tests.support import wait_for


def _cmdlines() -> list[str]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                out.append((d / "cmdline").read_bytes().decode(errors="replace").replace("\0", " "))
            except OSError:
                pass
    return out


def _heads() -> set[str]:
    """Temp dirs of the embedded heads whose processes are alive."""
    found = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            for part in cmd.split("\0"):
                if "/tmp/fsray" in part:
                    found.add(part[part.index("/tmp/fsray"):].split("/")[2])
    return found


def test_ports_are_explicit_and_free_ones_are_picked():
    ports = RayPorts(dashboard_agent=40001).resolved()
    assert ports.dashboard_agent == 40001 and all(p > 0 for p in vars(ports).values())
    flags = ports.flags()
    assert "--dashboard-agent-listen-port=40001" in flags and f"--port={ports.gcs}" in flags
    assert len({f.split("=")[0] for f in flags}) == len(vars(ports))


def _own_head(srv: ServeProcess) -> str:
    """The temp dir name of the head a server started (from its log)."""
    m = re.search(r"embedded Ray head at \S+ in /tmp/(fsray\w+)", srv.log_path.read_text())
    assert m, srv.log_path.read_text()[-2000:]
    return m.group(1)


def test_two_servers_with_embedded_heads_on_one_machine(tmp_path):
    servers = [ServeProcess.start(tmp_path / f"serve{i}.log", "--workers", "1", "--dtype", "float32",
                                  join_session=False, timeout_s=240, env={"FUSEDSERVE_LOG": "INFO"})
               for i in range(2)]
    try:
        heads = {_own_head(srv) for srv in servers}
        assert len(heads) == 2 and heads <= _heads(), "each server started a head of its own"
        for srv in servers:
            with Client(srv.address, timeout_s=120) as c:
                out = c.generate("two servers", max_tokens=6, ignore_eos=True)
            assert len(out["token_ids"]) == 6
        for head in heads:
            logs = Path("/tmp", head).glob("session_*/logs/dashboard_agent.log")
            text = "".join(p.read_text(errors="replace") for p in logs)
            assert "Failed to bind" not in text and "address already in use" not in text
    finally:
        for srv in servers:
            srv.stop()
    for srv in servers:
        assert srv.proc.returncode == 0, srv.log_path.read_text()[-3000:]
    wait_for(lambda: not (heads & _heads()), 30, "both embedded heads to stop")
    assert not any(Path("/tmp", h).exists() for h in heads), "their temp dirs are removed"


def test_a_head_that_cannot_start_says_why_and_leaves_nothing():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match="could not start an embedded Ray head"):
            EmbeddedHead.start(1, RayPorts(gcs=port), timeout_s=60)
        # Its processes would carry this port in their command lines.
    wait_for(lambda: not [p for p in _cmdlines() if f"--port={port}" in p or f"gcs_server_port={port}" in p],
             30, "the failed head's processes to be gone")

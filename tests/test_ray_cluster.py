"""Embedded Ray heads: two servers on one machine, each with a head of its own, do not
collide on Ray's fixed agent ports, and each head goes away with its server."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from coordinator.client import Client
from coordinator.ray_cluster import EmbeddedHead, RayPorts
from tests.serve_proc import ServeProcess
from tests.support import wait_for


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


def test_two_servers_with_embedded_heads_on_one_machine(tmp_path):
    before = _heads()
    servers = [ServeProcess.start(tmp_path / f"serve{i}.log", "--workers", "1", "--dtype", "float32",
                                  join_session=False, timeout_s=240) for i in range(2)]
    try:
        heads = _heads() - before
        assert len(heads) == 2, "each server started a head of its own"
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
    wait_for(lambda: not (_heads() - before), 30, "both embedded heads to stop")
    assert not any(Path("/tmp", h).exists() for h in heads), "their temp dirs are removed"


def test_a_head_that_cannot_start_says_why_and_leaves_nothing():
    before = _heads()
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError, match="could not start an embedded Ray head"):
            EmbeddedHead.start(1, RayPorts(gcs=port), timeout_s=60)
    wait_for(lambda: not (_heads() - before), 30, "the failed head's processes to be gone")

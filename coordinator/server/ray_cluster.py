"""The Ray cluster a server runs its workers on: an existing one, or a head of its own.

``ray.init()`` with no address starts a head whose dashboard agent always binds port
52365, so a second server on the same machine finds it taken (its agent retries, then
runs without its HTTP server). An embedded head here is started with ``ray start
--head`` instead, every port explicit (free ones unless set), in a temp dir of its own,
and stopped with the server: only its processes, never another cluster's.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class RayPorts:
    """Ports of an embedded head's per-node agents; 0 picks a free one at start."""

    gcs: int = 0
    dashboard_agent: int = 0  # dashboard agent HTTP (Ray's fixed default is 52365)
    dashboard_agent_grpc: int = 0
    metrics_export: int = 0
    runtime_env_agent: int = 0
    node_manager: int = 0
    object_manager: int = 0

    def resolved(self) -> RayPorts:
        spare = iter(free_ports(len(fields(self))))  # distinct: all held open while they are picked
        return RayPorts(**{f.name: getattr(self, f.name) or next(spare) for f in fields(self)})

    def flags(self) -> list[str]:
        names = {"gcs": "port", "dashboard_agent": "dashboard-agent-listen-port",
                 "dashboard_agent_grpc": "dashboard-agent-grpc-port"}
        return [f"--{names.get(f.name, f.name.replace('_', '-') + '-port')}={getattr(self, f.name)}"
                for f in fields(self)]


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now: each socket stays bound until every port is picked (one at a
    time, the kernel may hand the same port out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _pids_of(temp_dir: str) -> list[int]:
    """Processes of the Ray head started with ``temp_dir`` (it is in their command lines)."""
    found, me, key = [], os.getpid(), temp_dir.encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != me:
            try:
                if key in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def stop_head(temp_dir: str, grace_s: float = 5.0) -> None:
    """End the processes of the head started with ``temp_dir``, and only those (SIGTERM, then
    SIGKILL after ``grace_s``; not ``ray stop``, which ends every cluster on the machine),
    and remove its temp dir."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = _pids_of(temp_dir)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait_s
        while pids and _pids_of(temp_dir) and time.time() < deadline:
            time.sleep(0.1)
    shutil.rmtree(temp_dir, ignore_errors=True)


class EmbeddedHead:
    """A local Ray head owned by one server process."""

    def __init__(self, temp_dir: str, ports: RayPorts):
        self.temp_dir = temp_dir
        self.ports = ports

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.ports.gcs}"

    @classmethod
    def start(cls, num_cpus: int, ports: RayPorts | None = None, timeout_s: float = 120.0) -> EmbeddedHead:
        ray_cli = Path(sys.executable).parent / "ray"
        if not ray_cli.exists():
            raise RuntimeError(f"the ray CLI is not beside {sys.executable}; install ray[default] there")
        ports = (ports or RayPorts()).resolved()
        temp_dir = tempfile.mkdtemp(prefix="fsray", dir="/tmp")  # short: Ray puts sockets in it
        cmd = [str(ray_cli), "start", "--head", f"--num-cpus={num_cpus}", "--include-dashboard=false",
               "--disable-usage-stats", f"--temp-dir={temp_dir}", *ports.flags()]
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        head = cls(temp_dir, ports)
        try:
            subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=timeout_s)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            head.stop()
            out = getattr(exc, "stderr", "") or ""
            raise RuntimeError(f"could not start an embedded Ray head: {out[-2000:]}") from None
        log.info("embedded Ray head at %s in %s (ports %s)", head.address, temp_dir, ports)
        return head

    def stop(self, grace_s: float = 5.0) -> None:
        stop_head(self.temp_dir, grace_s)


def connect(address: str | None, num_cpus: int, ports: RayPorts | None = None) -> EmbeddedHead | None:
    """Join the cluster at ``address`` ("auto": the one this process was started in), or start
    an embedded head; returns the head to stop at exit (None when joining)."""
    import ray

    head = None
    if not address:
        head = EmbeddedHead.start(num_cpus, ports)
        address = head.address
    ray.init(address=address, log_to_driver=False)
    return head

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
import secrets
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


# Ray's single-node mode (its name notwithstanding: ``ENABLE_RAY_CLUSTER`` off): the node's address is
# the loopback one, so with ``--node-ip-address=127.0.0.1`` every server of the head, its agents and
# workers, and this process's driver listen on loopback alone. Read when ``ray`` is imported.
LOCAL_ONLY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def embedded_env() -> dict[str, str]:
    """The environment an embedded head and this driver share: loopback only, and one auth mode.

    Ray's defaults differ (``ray start`` turns token auth on once ``~/.ray/auth_token`` exists, a
    driver stays disabled) and a driver fixes its mode when ``ray`` is imported: so set this
    first. Token auth with a fresh token of the head's own, unless the caller chose token auth
    already; once ``ray`` is imported, the driver's mode, whatever it is."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode == "token":
        auth = {"RAY_AUTH_MODE": "token"}  # its token from RAY_AUTH_TOKEN or the token file
    elif "ray" in sys.modules:
        auth = {"RAY_AUTH_MODE": mode or "disabled"}
    else:
        auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    return {**LOCAL_ONLY_ENV, **auth}


def session_of(pid: int) -> int | None:
    """The session id of a process (``/proc/PID/stat``), or None once it is gone."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[3])


def session_pids(session: int) -> list[int]:
    """Every process in a session, whoever its parent is now (Ray's agents are reparented to init
    and ignore SIGTERM: counting by parentage misses them)."""
    me = os.getpid()
    return [int(d.name) for d in Path("/proc").iterdir()
            if d.name.isdigit() and int(d.name) != me and session_of(int(d.name)) == session]


def _pids_of(temp_dir: str, session: int | None = None) -> list[int]:
    """Processes of the Ray head started with ``temp_dir`` (in their command lines) or in its
    session."""
    found, me, key = set(), os.getpid(), temp_dir.encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != me:
            try:
                if key in (d / "cmdline").read_bytes():
                    found.add(int(d.name))
            except OSError:
                pass
    if session is not None:
        found.update(session_pids(session))
    return sorted(found)


def stop_head(temp_dir: str, grace_s: float = 5.0, session: int | None = None) -> None:
    """End the processes of the head started with ``temp_dir`` (and, given its ``session``, every
    process of that session, agents included), and only those (SIGTERM, then SIGKILL after
    ``grace_s``; not ``ray stop``, which ends every cluster on the machine), and remove its temp
    dir."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = _pids_of(temp_dir, session)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + wait_s
        while pids and _pids_of(temp_dir, session) and time.time() < deadline:
            time.sleep(0.1)
    shutil.rmtree(temp_dir, ignore_errors=True)


REAPER_ENV = "FUSEDSERVE_HEAD_REAPER"  # "0": no watchdog (the tests' negative control)


def spawn_reaper(temp_dir: str | None = None, session: int | None = None) -> subprocess.Popen | None:
    """The watchdog that cleans up after this process if it dies without stopping (``head_reaper.py``),
    in a session of its own: ends its embedded head (``temp_dir``, ``session``) if it has one, and
    unlinks its shared-memory segments; None where ``FUSEDSERVE_HEAD_REAPER=0``."""
    if os.environ.get(REAPER_ENV, "1").strip() == "0":
        return None
    cmd = [sys.executable, "-m", "fusedserve.coordinator.server.head_reaper", "--parent", str(os.getpid())]
    if temp_dir is not None and session is not None:
        cmd += ["--temp-dir", temp_dir, "--session", str(session)]
    return subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL)


class EmbeddedHead:
    """A local Ray head owned by one server process: in a session of its own, every server of it
    on loopback (``LOCAL_ONLY_ENV``), every process of it ended with it, by ``stop`` or, if the
    server is killed, by its reaper."""

    def __init__(self, temp_dir: str, ports: RayPorts, session: int | None = None):
        self.temp_dir = temp_dir
        self.ports = ports
        self.session = session
        self.reaper: subprocess.Popen | None = None

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
               "--disable-usage-stats", "--node-ip-address=127.0.0.1", f"--temp-dir={temp_dir}",
               *ports.flags()]
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", **LOCAL_ONLY_ENV)
        env.pop("RAY_ADDRESS", None)
        # A session of its own: `ray start` leads it and every process it starts stays in it.
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        head = cls(temp_dir, ports, proc.pid)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        if proc.returncode != 0:
            head.stop()
            raise RuntimeError(f"could not start an embedded Ray head: {(err or '')[-2000:]}")
        log.info("embedded Ray head at %s in %s (session %d, ports %s)", head.address, temp_dir, proc.pid,
                 ports)
        head.reaper = spawn_reaper(temp_dir, proc.pid)
        return head

    def stop(self, grace_s: float = 5.0) -> None:
        stop_head(self.temp_dir, grace_s, self.session)
        if self.reaper is not None:  # nothing left for it to end
            self.reaper.kill()
            self.reaper.wait()


def connect(address: str | None, num_cpus: int, ports: RayPorts | None = None) -> EmbeddedHead | None:
    """Join the cluster at ``address`` ("auto": the one this process was started in), or start
    an embedded head; returns the head to stop at exit (None when joining)."""
    head = None
    if not address:
        if "ray" in sys.modules and any(os.environ.get(k) != v for k, v in LOCAL_ONLY_ENV.items()):
            log.warning("ray was imported before the embedded head's loopback mode was set: this driver "
                        "may listen beyond loopback (the CLI sets %s first)", LOCAL_ONLY_ENV)
        os.environ.update(embedded_env())
        head = EmbeddedHead.start(num_cpus, ports)
        address = head.address
    import ray

    # Workers' logs come here: warnings, and the progress bars of their weights loading.
    if head is None:
        ray.init(address=address)
        spawn_reaper()  # a joined cluster's actors die with their owner; its segments are the watchdog's
        return head
    try:
        ray.init(address=address, _node_ip_address="127.0.0.1")
    except BaseException:  # the head is ours: it must not outlive a driver that never joined it
        head.stop()
        raise
    return head

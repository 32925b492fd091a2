"""Two Ray nodes on one machine as real network hosts: a network namespace joined to this
one by a veth pair, with its own /dev/shm (a private mount), runs the second raylet. The
server's worker there cannot map the coordinator's arenas, so it serves over the serializing
transport; killing that node mid-stream loses no request. Then the same with a tensor-parallel
group of two ranks on each node (data parallel across the nodes, as deploy/multinode.md lays out).

Needs root, iproute2 (``ip netns``) and util-linux (``unshare``); skipped without them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.server.ray_cluster import free_port, free_ports, stop_head
from tests.serve_proc import ServeProcess
from tests.support import assert_streams_exact, exits_within, stream_requests, wait_for

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"),
    reason="network namespaces need root, iproute2 and unshare")

RAY = str(os.path.join(os.path.dirname(sys.executable), "ray"))
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
ENV.pop("RAY_ADDRESS", None)
ARGS = ("--workers", "2", "--dtype", "float32", "--max-batch", "8", "--num-blocks", "128")
PROMPTS = [f"Request {i}: the module provides" for i in range(8)]


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


def _agent_ports(gcs: int) -> list[str]:
    """Distinct free ports for a node's agents, none of them the head's GCS port."""
    names = ("dashboard-agent-listen", "dashboard-agent-grpc", "metrics-export", "runtime-env-agent",
             "node-manager", "object-manager")
    ports = [p for p in free_ports(len(names) + 1) if p != gcs]
    return [f"--{name}-port={port}" for name, port in zip(names, ports)]


class TwoNodes:
    """A Ray head on this host's end of a veth pair, a second node inside a namespace."""

    def __init__(self, cpus: int = 1) -> None:
        self.cpus = cpus  # per node: the ranks of one worker
        tag = os.getpid() % 200 + 20
        self.ns, self.veth = f"fsn{tag}", f"fsv{tag}"
        self.head_ip, self.node_ip = f"10.77.{tag}.1", f"10.77.{tag}.2"
        self.head_tmp = tempfile.mkdtemp(prefix="fsh", dir="/tmp")
        self.node_tmp = tempfile.mkdtemp(prefix="fsn", dir="/tmp")
        self.node: subprocess.Popen | None = None
        self.gcs = free_port()

    def start(self) -> None:
        _sh("ip", "netns", "add", self.ns)
        _sh("ip", "link", "add", self.veth + "a", "type", "veth", "peer", "name", self.veth + "b")
        _sh("ip", "link", "set", self.veth + "b", "netns", self.ns)
        _sh("ip", "addr", "add", f"{self.head_ip}/24", "dev", self.veth + "a")
        _sh("ip", "link", "set", self.veth + "a", "up")
        for cmd in (("ip", "addr", "add", f"{self.node_ip}/24", "dev", self.veth + "b"),
                    ("ip", "link", "set", self.veth + "b", "up"), ("ip", "link", "set", "lo", "up")):
            _sh("ip", "netns", "exec", self.ns, *cmd)
        # One worker's CPUs a node: each worker (one CPU per rank) goes to a node of its own.
        subprocess.run([RAY, "start", "--head", f"--port={self.gcs}", f"--node-ip-address={self.head_ip}",
                        f"--num-cpus={self.cpus}", "--include-dashboard=false", "--disable-usage-stats",
                        f"--temp-dir={self.head_tmp}", *_agent_ports(self.gcs)],
                       env=ENV, check=True, capture_output=True, timeout=120)
        node = (f"mount -t tmpfs tmpfs /dev/shm && exec {RAY} start --address={self.address} "
                f"--node-ip-address={self.node_ip} --num-cpus={self.cpus} --disable-usage-stats "
                f"--temp-dir={self.node_tmp} --block " + " ".join(_agent_ports(self.gcs)))
        self.node = subprocess.Popen(["ip", "netns", "exec", self.ns, "unshare", "-m", "--propagation",
                                      "private", "sh", "-c", node], env=ENV, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

    @property
    def address(self) -> str:
        return f"{self.head_ip}:{self.gcs}"

    def node_pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]

    def kill_node(self) -> None:
        """The second host is lost: every process in its namespace killed at once."""
        for pid in self.node_pids():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def link(self, up: bool) -> None:
        """The second host's network link (not its processes): down drops every packet both ways."""
        _sh("ip", "link", "set", self.veth + "a", "up" if up else "down")

    def stop(self) -> None:
        self.kill_node()
        if self.node is not None:
            self.node.wait(timeout=30)
        stop_head(self.head_tmp, grace_s=5)
        shutil.rmtree(self.node_tmp, ignore_errors=True)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.veth + "a"], capture_output=True, timeout=30)


@pytest.fixture
def nodes(request):
    cluster = TwoNodes(request.param)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.parametrize("nodes", [1, 2], indirect=True, ids=["one-device-workers", "tp2-group-per-node"])
def test_a_remote_node_serves_serially_and_losing_it_loses_nothing(nodes, tmp_path):
    rc = dict(max_batch=8, num_blocks=128)
    params = [SamplingParams(max_tokens=48, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    with LLMEngine("default", dtype="float32", **rc) as eng:
        want = [o.token_ids for o in eng.generate(PROMPTS, params)]
    srv = ServeProcess.start(tmp_path / "serve.log", *ARGS, "--ray-address", nodes.address,
                             "--tensor-parallel-size", str(nodes.cpus), join_session=False)
    try:
        with Client(srv.address, timeout_s=120) as c:
            workers = c.workers()
        assert sorted(w["transport"] for w in workers) == ["serial", "shm"], workers
        assert len({w["node_id"] for w in workers}) == 2
        assert all(len(w["ranks"]) == nodes.cpus for w in workers), workers
        got: dict[int, list[int]] = {}
        first = threading.Event()

        def stream(i: int) -> None:
            with Client(srv.address, timeout_s=120) as c:
                ids = []
                for frame in c.stream(PROMPTS[i], max_tokens=48, temperature=0.8, seed=i, ignore_eos=True):
                    if frame["type"] == "token":
                        ids.append(frame["token"])
                        if len(ids) == 8:
                            first.set()
                    else:
                        assert frame["token_ids"] == ids
                got[i] = ids

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        assert first.wait(120), "no stream got going"
        nodes.kill_node()  # mid-stream: the remote worker's requests re-run on the head's worker
        for t in threads:
            t.join(timeout=300)
        assert [got.get(i) for i in range(len(PROMPTS))] == want
        with Client(srv.address, timeout_s=30) as c:
            faults = c.stats()["faults"]
        assert faults["reruns"] >= 1, faults  # the lost node's requests moved and re-ran
    finally:
        srv.stop()
    wait_for(lambda: not nodes.node_pids(), 30, "the lost node's processes to be gone")


def _time_to_move(c: Client, t_drop: float, seconds: float) -> float | None:
    """Seconds from the drop until the coordinator gave up on a worker (None: not within ``seconds``)."""
    deadline = t_drop + seconds
    while time.time() < deadline:
        failures = c.stats()["faults"]["worker_failures"]
        if failures:
            return failures[0]["at"] - t_drop
        time.sleep(0.05)
    return None


# The negative control: a heartbeat bound longer than the outage, and the checks fire (nothing moves
# within the bound, the stale worker lives on).
LINK = [("0.6", True), ("30", False)]


@pytest.mark.slow
@pytest.mark.parametrize("heartbeat_s,moves", LINK, ids=["heartbeat-0.6s", "negative-control-30s"])
def test_a_link_lost_for_ten_seconds_moves_its_requests_and_retires_the_stale_worker(tmp_path, heartbeat_s,
                                                                                    moves):
    """The second node's link (not its processes) drops for 10 s under load: its requests re-run on
    the first node within the heartbeat bound and finish exactly, each token delivered once; the
    stale worker retires itself while still cut off (so nothing it held can come back), and once
    the link is back a new incarnation joins there and serves."""
    prompts = [f"Link {i}: the module provides" for i in range(8)]
    params = [{"max_tokens": 160, "temperature": 0.8, "seed": i, "ignore_eos": True} for i in range(8)]
    greedy_params = [{"max_tokens": 32}] * len(prompts)
    with LLMEngine("default", dtype="float32", max_batch=8, num_blocks=128) as eng:
        want = [o.token_ids for o in eng.generate(prompts, [SamplingParams(**p) for p in params])]
        greedy = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=32))]
    nodes = TwoNodes(1)
    srv = None
    try:
        nodes.start()
        srv = ServeProcess.start(tmp_path / "serve.log", *ARGS, "--ray-address", nodes.address,
                                 "--worker-heartbeat-timeout", heartbeat_s, join_session=False)
        with Client(srv.address, timeout_s=120) as c:
            remote = next(w for w in c.workers() if w["transport"] == "serial")
            streams = stream_requests(srv.address, prompts, params)
            for _ in prompts:
                assert streams.progressed.acquire(timeout=120), "every stream has 4 tokens before the drop"
            t_drop = time.time()
            nodes.link(False)
            try:
                moved_s = _time_to_move(c, t_drop, 3.0)
                retired = exits_within(remote["pid"], 5.0 - (time.time() - t_drop))
                print(f"heartbeat bound {heartbeat_s} s: requests moved after {moved_s} s; the cut-off "
                      f"worker retired itself: {retired}")
                time.sleep(max(0.0, t_drop + 10 - time.time()))
            finally:
                nodes.link(True)
            assert (moved_s is not None) == moves and retired == moves
            assert_streams_exact(streams, want)

            def rejoined() -> bool:
                ws = c.workers()
                return len(ws) == 2 and any(w["node_id"] == remote["node_id"] for w in ws)
            wait_for(rejoined, 120, "a worker on the second node again", every_s=0.5)
            assert_streams_exact(stream_requests(srv.address, prompts, greedy_params), greedy)
            stats = c.stats()
        on_node = [w for w in stats["workers"] if w["transport"] == "serial"]
        assert on_node and on_node[0]["tokens"] > 0, "the second node's worker serves again"
        assert (stats["faults"]["reruns"] > 0) == moves and stats["faults"]["fenced"] == 0
    finally:
        if srv is not None:
            srv.stop()
        nodes.stop()

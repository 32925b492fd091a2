"""Helpers shared by the tests that talk to a server or wait on other processes."""

from __future__ import annotations

import ipaddress
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import zmq

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.output_processor import OutputProcessor
from fusedserve.coordinator.engine.scheduled_batch import ScheduledBatch
from fusedserve.coordinator.engine.scheduler import Scheduler
from fusedserve.coordinator.engine.sequence import Sequence, TokenEvent
from fusedserve.coordinator.engine.step_outputs import StepOutputs
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.server.config import ServerConfig
from fusedserve.coordinator.server.server import Server
from fusedserve.shared_memory.arena import HostArena, pid_alive
from fusedserve.shared_memory.contract import LaunchDescriptor, LaunchReply

if TYPE_CHECKING:
    from fusedserve.coordinator.openai.http_server import HttpServer


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


_ARRIVALS = itertools.count()


def queue(sched: Scheduler, seq_id: str, prompt_ids: list[int], params: SamplingParams) -> Sequence:
    """A request queued on a bare scheduler (no tokenizer, no model), numbered on arrival."""
    seq = Sequence(seq_id, list(prompt_ids), params, arrival=next(_ARRIVALS))
    sched.enqueue(seq)
    return seq


def read_step(sched: Scheduler, batch: ScheduledBatch, out: StepOutputs,
              output: OutputProcessor | None = None) -> list[TokenEvent]:
    """What ``EngineCore.finish`` does with a launch's outputs, without a model: settle the
    scheduler's rows, run the output processor, retire what finished."""
    output = output or OutputProcessor((), sched.max_model_len)
    events = output.process(batch, sched.settle(batch), out)
    sched.update(events)
    return events


@contextmanager
def running_server(**settings: object) -> Iterator[Server]:
    """An in-process server (``ServerConfig.build`` names; one CPU worker on a free port unless
    given) with its loop on a thread, shut down when the block ends. Needs a Ray session."""
    coord = Server(ServerConfig.build(**{"workers": 1, "device": "cpu", "port": 0, **settings}))
    coord.start()
    try:
        coord.serve_in_thread()
        yield coord
    finally:
        coord.shutdown()


class EchoRunner:
    """A model-free runner behind the real contract: it reads the inputs the coordinator wrote into
    an arena bank and writes the outputs the coordinator reads, and row r samples (its last input
    token + 1) % vocab, fed on the "device" (here: its own last ids) where the coordinator has not
    read its input yet. A request's output is then known without a model: prompt[-1] + 1, + 2, ...
    whatever the batching. Logprob rows get -(token / vocab), top-n the next n ids at -1 each."""

    def __init__(self, arenas: list[HostArena], vocab: int):
        self.arenas, self.vocab = arenas, vocab
        self.last = np.zeros(0, dtype=np.int32)  # the previous launch's sampled ids
        self.launches: list[LaunchDescriptor] = []

    def execute(self, desc: LaunchDescriptor) -> LaunchReply:
        a, d = self.arenas[desc.bank], desc.dims
        b = d["B"]
        ids = a.view("token_ids", (d["T"],)).numpy()
        ends = a.view("query_start_loc", (d["B1"],)).numpy()[1:] - 1
        feed = a.view("feed_rows", (b,)).numpy()
        last = np.where(feed >= 0, self.last[np.maximum(feed, 0)] if len(self.last) else 0, ids[ends])
        out = ((last.astype(np.int64) + 1) % self.vocab).astype(np.int32)
        a.view("sampled_ids", (b,)).numpy()[:] = out
        rows = a.view("logprob_rows", (d["NL"],)).numpy()
        a.view("sampled_logprobs", (d["NL"],)).numpy()[:] = -(out[rows] / self.vocab)
        top = a.view("top_logprob_ids", (d["NL"], d["N"])).numpy()
        top[:] = (out[rows][:, None] + np.arange(d["N"])[None, :]) % self.vocab
        a.view("top_logprob_values", (d["NL"], d["N"])).numpy()[:] = -1.0
        self.last = out
        self.launches.append(desc)
        return LaunchReply(True, d2h=b * 4)


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket the processes listen on, from /proc/net/tcp{,6}
    (an IPv4-mapped IPv6 address is given as its IPv4 form)."""
    listen: dict[str, tuple[str, int]] = {}
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] != "0A":  # TCP_LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if v6:  # four little-endian 32-bit words
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                addr = ipaddress.IPv6Address(raw)
                addr = addr.ipv4_mapped or addr
            else:
                addr = ipaddress.IPv4Address(raw[::-1])
            listen[f[9]] = (str(addr), int(hexport, 16))
    found = []
    for pid in pids:
        try:
            fds = list((Path("/proc") / str(pid) / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in listen:
                found.append((pid, *listen[target[8:-1]]))
    return found


@contextmanager
def serving_http(coord: Server, ssl_keyfile: str | None = None, ssl_certfile: str | None = None,
                 **settings: object) -> Iterator[HttpServer]:
    """The OpenAI gateway of a running coordinator on an ephemeral port, as ``serve`` builds it
    (``settings``: ``GatewayConfig`` or ``HttpConfig`` fields). Its model is named ``default`` and
    tool_choice auto is on (``--enable-auto-tool-choice``) unless ``settings`` say otherwise."""
    from fusedserve.coordinator.openai.gateway import Gateway, GatewayConfig
    from fusedserve.coordinator.openai.http_server import HttpServer

    settings = {"served_model_name": ("default",), "enable_auto_tool_choice": True, **settings}
    gw = Gateway(GatewayConfig.for_server(coord, port=0, ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile,
                                          **settings), coord.tokenizer)
    http = HttpServer(gw)
    http.start()
    try:
        yield http
    finally:
        http.stop()


@dataclass
class Streams:
    """Concurrent streaming clients, one thread per request: each one's frames, or its exception,
    and a semaphore released once per request when its fourth token arrives (the moment a fault
    test strikes)."""

    frames: dict[int, list[dict]]
    errors: dict[int, BaseException] = field(default_factory=dict)
    progressed: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(0))
    threads: list[threading.Thread] = field(default_factory=list)

    def join(self, timeout_s: float = 300) -> None:
        for t in self.threads:
            t.join(timeout=timeout_s)


def stream_requests(address: str, prompts: list, params: list[dict]) -> Streams:
    """Start streaming every prompt (with its params) to the server at ``address``."""
    streams = Streams({i: [] for i in range(len(prompts))})

    def one(i: int) -> None:
        try:
            with Client(address, timeout_s=300) as c:
                for f in c.stream(prompts[i], **params[i]):
                    streams.frames[i].append(f)
                    if f.get("index") == 3:
                        streams.progressed.release()
        except BaseException as exc:  # noqa: BLE001 - reported by the caller's assertions
            streams.errors[i] = exc

    streams.threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in streams.threads:
        t.start()
    return streams


def assert_streams_exact(streams: Streams, want: list[list[int]]) -> None:
    """Every stream ended once, with no token repeated or skipped, equal to ``want`` (the offline
    engine's): what a fault test asks of the requests that lived through it."""
    streams.join()
    assert not streams.errors, streams.errors
    for i, frames in streams.frames.items():
        tokens = [f for f in frames if f["type"] == "token"]
        dones = [f for f in frames if f["type"] == "done"]
        assert len(dones) == 1 and frames[-1] is dones[0], f"request {i} finished exactly once"
        assert [f["index"] for f in tokens] == list(range(len(tokens))), f"request {i}: no repeats"
        assert [f["token"] for f in tokens] == dones[0]["token_ids"] == want[i], f"request {i}"


def exits_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` is gone within ``seconds``."""
    deadline = time.time() + seconds
    while pid_alive(pid):
        if time.time() > deadline:
            return False
        time.sleep(0.05)
    return True

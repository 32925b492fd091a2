"""The Ray actor that owns one device.

Lifecycle calls (start, stop) are Ray calls; the per-step launch
descriptors arrive on a ZeroMQ PAIR socket served by a thread of the actor, since a
Ray call costs milliseconds against a step of tens of milliseconds. Under tensor parallelism a
worker is a group of these actors, one per device (``worker/tensor_group.py``): rank 0 owns the
step socket and relays each launch to the others, which follow it.

A worker is one incarnation (its ``epoch``): the coordinator connects to its endpoint once and
never again, so once that connection is gone (the coordinator closed it on replacing this worker,
or its heartbeats stopped: the coordinator died or the link dropped) the worker retires itself
rather than wait for a kill that a lost link may never deliver.
"""

from __future__ import annotations

import logging
import os
import threading
import time

import msgpack
import ray
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from fusedserve.shared_memory import transport
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.contract import (
    HEARTBEAT_TIMEOUT_MS,
    LaunchDescriptor,
    LaunchReply,
    heartbeat_interval_ms,
)
from fusedserve.shared_memory.engine_config import EngineConfig
from fusedserve.shared_memory.slots import step_table
from fusedserve.worker.device import torch_device
from fusedserve.worker.load_progress import weight_progress
from fusedserve.worker.model.qwen3 import Qwen3Model, prepare_kernels
from fusedserve.worker.model.tensor_parallel import SINGLE, GroupBroken
from fusedserve.worker.model_runner import ModelRunner
from fusedserve.worker.tensor_group import STOP, GroupRank, TensorGroup, rendezvous_address

log = logging.getLogger(__name__)

REPLY_FLUSH_S = 0.2  # a failed group's rank 0 waits this long for its last reply to leave


class WorkerActor:
    """One device: weights, KV cache, scratch pool; executes launches on request."""

    def __init__(self, worker_id: str, device_kind: str = "cpu", threads: int = 0,
                 cores: list[int] | None = None, epoch: int = 0, heartbeat_timeout_ms: int = 0):
        """``threads``: torch's (0: its default); ``cores``: the CPUs this rank runs on, its own;
        ``epoch``: this incarnation's number; ``heartbeat_timeout_ms``: how long a silent
        coordinator connection lives (0: ``contract.HEARTBEAT_TIMEOUT_MS``)."""
        self.worker_id = worker_id
        self.epoch = epoch
        self.heartbeat_timeout_ms = heartbeat_timeout_ms or HEARTBEAT_TIMEOUT_MS
        self.device_kind = device_kind
        if cores and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cores)
        if threads > 0:
            torch.set_num_threads(threads)
        self.runner: ModelRunner | None = None
        self.arenas: list[HostArena] = []
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ctx = zmq.Context.instance()
        self.serial = False
        self.group: TensorGroup | None = None

    def rendezvous(self) -> str:
        """Rank 0 of a group: the address the group's ranks meet at."""
        return rendezvous_address()

    def start(self, cfg: EngineConfig, arena_names: list[str | None], host: str = "127.0.0.1",
              rank: GroupRank | None = None, rendezvous: str | None = None) -> dict:
        """Load the model of the resolved ``cfg`` (this rank's share of it in a group), attach the
        arena banks, allocate everything, warm up, open the step socket (rank 0) or follow rank 0.

        A ``None`` name selects the serializing transport (a worker on another node): the
        worker keeps private banks and launch messages carry the HOST_SHARED bytes.
        """
        device = torch_device(self.device_kind)
        tp = SINGLE
        if rank is not None and rank.size > 1:
            self.group = TensorGroup(rank, rendezvous, device, self._ctx)
            tp = self.group.tp
        m = cfg.model
        who = self.worker_id if rank is None or rank.size == 1 else f"{self.worker_id} rank {rank.rank}"
        prepare_kernels(device)
        progress, bar = weight_progress(f"{who}: loading weights", in_ray_worker=True)
        try:
            model = Qwen3Model.from_pretrained(m.model, m.dtype, device, m.max_model_len, m.quantization,
                                               tp=tp, progress=progress, gemm=cfg.device.cpu_gemm)
        finally:
            bar.close()
        table, dims = step_table(), cfg.max_dims(model.config.vocab_size)
        self.arenas = []
        try:
            self.arenas = [HostArena.attach(name, table, dims) for name in arena_names
                           if name is not None]
        except FileNotFoundError:  # another node: the coordinator's memory is not here
            log.info("arenas %s not on this node: serializing transport", arena_names)
            for arena in self.arenas:
                arena.close()
            self.arenas = []
        self.serial = len(self.arenas) < len(arena_names)
        if self.serial:
            self.arenas = [HostArena.create(table, dims, tag="remote") for _ in arena_names]
            if any(arena_names):  # truly off-node (not forced): reachable on the node's address
                host = ray.util.get_node_ip_address()
        leader = self.group is None or self.group.leader
        self.runner = ModelRunner(model, cfg, self.arenas, writes_outputs=leader)
        info = {"pid": os.getpid(), "device": str(device), "transport": "serial" if self.serial else "shm",
                "node_id": ray.get_runtime_context().get_node_id(), "kv_bytes": self.runner.kv.nbytes,
                "draft_kv_bytes": self.runner.drafter.nbytes if self.runner.drafter else 0,
                "pool_bytes": self.runner.pool.nbytes, "kernels": model.kernel_info()}
        if not leader:
            self._thread = threading.Thread(target=self._follow, daemon=True, name=f"follow-{self.worker_id}")
            self._thread.start()
            return info
        sock = self._ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_interval_ms(self.heartbeat_timeout_ms))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.heartbeat_timeout_ms)
        port = sock.bind_to_random_port(f"tcp://{host}")
        self._thread = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                        name=f"steps-{self.worker_id}")
        self._thread.start()
        return {"endpoint": f"tcp://{host}:{port}", **info}

    def _serve(self, sock: zmq.Socket) -> None:
        coordinator = CoordinatorLink(sock)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(coordinator.monitor, zmq.POLLIN)
        sent: float | None = None  # when the previous reply went out
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if coordinator.monitor in ready and coordinator.gone():
                self._retire("its coordinator's connection closed or stopped answering heartbeats")
            if sock not in ready:
                continue
            raw = sock.recv()
            waited = time.perf_counter() - sent if sent is not None else 0.0
            msg = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            if msg.get("epoch", 0) != self.epoch:  # not for this incarnation: nobody to answer
                log.warning("%s: dropped a launch for incarnation %s", self.worker_id, msg.get("epoch"))
                continue
            if self.group is not None:
                self._relay(raw)
            reply = self._execute(msg)
            reply.wait = waited  # blocked on the coordinator: nothing queued behind the last launch
            reply.epoch, reply.step = self.epoch, msg.get("step", -1)
            try:
                sock.send(msgpack.packb(reply.to_wire()), zmq.NOBLOCK)
            except zmq.Again:  # PAIR without its peer: the coordinator is gone
                self._retire("its coordinator left while a launch ran")
            sent = time.perf_counter()
            if self.group is not None and not reply.ok:
                # The other ranks may have stopped at another collective, or none: their next
                # collectives would pair with the wrong ones. The launch's requests fail as on one
                # device; the group is replaced (once the reply is out) and the rest re-run.
                time.sleep(REPLY_FLUSH_S)
                _leave_group(GroupBroken(f"launch failed on rank 0: {reply.error}"))
        sock.close(0)

    def _follow(self) -> None:
        """Another rank of a group: run every launch rank 0 relays; rank 0 replies for all."""
        while not self._stop.is_set():
            raw = self.group.receive(100)
            if raw is None:
                continue
            if raw == STOP:
                if not self._stop.is_set():  # rank 0 left without a stop call here: so does this rank
                    self._retire("rank 0 of its group stopped")
                break
            reply = self._execute(msgpack.unpackb(raw, raw=False, strict_map_key=False))
            if not reply.ok:  # out of step with the group from here on (see _serve)
                _leave_group(GroupBroken(f"launch failed on rank {self.group.me.rank}: {reply.error}"))

    def _relay(self, raw: bytes) -> None:
        try:
            self.group.relay(raw)
        except GroupBroken as exc:
            _leave_group(exc)

    def _execute(self, msg: dict) -> LaunchReply:
        try:
            desc = LaunchDescriptor.from_wire(msg)
            table = self.runner.table
            if self.serial:
                transport.unpack(self.arenas[desc.bank], table, desc.dims, msg["inputs"], outputs=False)
            reply = self.runner.execute(desc)
            if self.serial and self.runner.runtime.writes_outputs:
                reply.outputs = transport.pack_outputs(self.arenas[desc.bank], table, desc.dims)
            return reply
        except GroupBroken as exc:
            _leave_group(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the coordinator, which decides
            log.exception("launch failed")
            return LaunchReply.failed(exc)

    def _retire(self, why: str) -> None:
        """Leave the process: its coordinator will never reach this incarnation again. The other
        ranks of a group are told to stop; banks this worker created are unlinked."""
        log.warning("%s (incarnation %d): %s; retiring", self.worker_id, self.epoch, why)
        self._stop.set()
        if self.group is not None:
            try:
                self.group.relay(STOP)
            except GroupBroken:
                pass
        for arena in self.arenas:
            arena.close()
        logging.shutdown()
        os._exit(0)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.group is not None and self.group.leader:
            try:
                self.group.relay(STOP)  # after the step thread left: it no longer uses the sockets
            except GroupBroken:
                pass  # a peer already gone: the pool kills the group
        if self.group is not None:
            self.group.close()
            self.group = None
        if self.runner is not None:
            self.runner.close()
        self.runner = None
        for arena in self.arenas:
            arena.close()
        self.arenas = []


class CoordinatorLink:
    """Watches a bound step socket for the end of the coordinator's one connection (the first
    one accepted; a stray connection's end does not count)."""

    def __init__(self, sock: zmq.Socket):
        self.monitor = sock.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.fd: int | None = None

    def gone(self) -> bool:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if event["event"] == zmq.EVENT_ACCEPTED and self.fd is None:
                self.fd = event["value"]
            elif event["event"] == zmq.EVENT_DISCONNECTED and event["value"] == self.fd:
                return True
        return False


def _leave_group(exc: GroupBroken) -> None:
    """A rank of a broken group exits: its group can compute nothing more, and a process that
    is gone is what the coordinator sees (rank 0's socket closes) and answers by re-running the
    group's requests on a replacement."""
    log.error("%s: leaving the process", exc)
    logging.shutdown()
    os._exit(70)

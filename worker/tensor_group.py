"""The ranks of one tensor-parallel worker: their process group, and the relay of launches.

To the coordinator a group is one worker: one step socket (rank 0's), one set of arena banks.
Rank 0 forwards every launch message, as received, to the other ranks over a ZeroMQ PAIR socket
each (bound on loopback: a placement group keeps a group on one node), then runs it; every rank
reads the HOST_SHARED inputs from the same arena banks (or, serialized, from the message) and
runs the same launch, meeting the others in the model's collectives. Only rank 0 writes outputs
and replies. Messages rather than a collective relay the launches, so an idle group waits in a
socket poll, never in a collective that would time out.

Collectives: NCCL on CUDA, HCCL on Ascend; on the CPU, a shared-memory file the ranks meet in
(``kernels/native/shm_comm.py``: microseconds where a gloo round trip costs a millisecond), or gloo
without the native build. A gloo group carries the start-up exchange. A collective that fails
(a peer gone) raises ``GroupBroken``; the rank that sees it exits its process, so the coordinator
sees the group's socket close and re-runs its requests on a replacement group.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import zmq

from fusedserve.kernels.native import build as native
from fusedserve.kernels.native.shm_comm import ShmComm
from fusedserve.shared_memory.arena import PREFIX, SHM_DIR
from fusedserve.worker.model.tensor_parallel import GroupBroken, TensorParallel

log = logging.getLogger(__name__)

STOP = b"stop"  # rank 0 -> peers: leave the loop (no launch message is this short)
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class GroupRank:
    """Where one actor stands in its worker's group (sent with its start call)."""

    rank: int
    size: int
    expert_parallel: bool = False
    timeout_s: float = 300.0  # a collective blocked this long fails: a peer hung


def rendezvous_address() -> str:
    """``host:port`` for the group's store, on rank 0's node (called on rank 0 before start)."""
    import ray

    with socket.socket() as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"{ray.util.get_node_ip_address()}:{port}"


class TensorGroup:
    def __init__(self, me: GroupRank, address: str, device: torch.device, ctx: zmq.Context):
        import torch.distributed as dist

        self.me = me
        backend = BACKENDS[device.type]
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, init_method=f"tcp://{address}", rank=me.rank, world_size=me.size,
                                timeout=timedelta(seconds=me.timeout_s), **kw)
        self._control = None if backend == "gloo" else dist.new_group(backend="gloo")
        pids: list[int] = [0] * me.size
        dist.all_gather_object(pids, os.getpid(), group=self._control)
        self.pids = [p for r, p in enumerate(pids) if r != me.rank]
        self.peers: list[zmq.Socket] = []  # rank 0: one relay socket per other rank
        self.sock: zmq.Socket | None = None  # another rank: its socket from rank 0
        self._open_relay(ctx)
        comm = self._shared_memory_comm() if backend == "gloo" else None
        self.tp = TensorParallel(me.rank, me.size, me.expert_parallel, comm)

    def _open_relay(self, ctx: zmq.Context) -> None:
        import torch.distributed as dist

        if self.leader:
            for _ in range(self.me.size - 1):
                s = ctx.socket(zmq.PAIR)
                s.setsockopt(zmq.LINGER, 0)
                s.bind_to_random_port("tcp://127.0.0.1")
                self.peers.append(s)
        endpoints = [[s.getsockopt_string(zmq.LAST_ENDPOINT) for s in self.peers]]
        dist.broadcast_object_list(endpoints, src=0, group=self._control)
        if not self.leader:
            self.sock = ctx.socket(zmq.PAIR)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(endpoints[0][self.me.rank - 1])

    def _shared_memory_comm(self) -> ShmComm | None:
        """CPU ranks' collectives: one shared file rank 0 creates, every rank maps, and rank 0
        unlinks once all have (nothing is left behind, even after a kill). None without the
        native build (gloo's collectives then)."""
        import torch.distributed as dist

        build = native.kernels()
        # Named like an arena segment: swept by the next start if rank 0 dies before unlinking it.
        name = f"{SHM_DIR}/{PREFIX}_{os.getpid()}_tp{uuid.uuid4().hex[:12]}"
        shared = [name if build is not None and self.leader else None]
        dist.broadcast_object_list(shared, src=0, group=self._control)
        path, rank, size = shared[0], self.me.rank, self.me.size
        if path is None:
            return None
        comm = ShmComm(path, rank, size, build, self.peers_alive, create=True) if self.leader else None
        dist.barrier(group=self._control)  # the file exists before the others map it
        if not self.leader:
            comm = ShmComm(path, rank, size, build, self.peers_alive)
        dist.barrier(group=self._control)
        if self.leader:
            comm.unlink(path)
        return comm

    def peers_alive(self) -> bool:
        return all(_alive(pid) for pid in self.pids)

    @property
    def leader(self) -> bool:
        return self.me.rank == 0

    def relay(self, raw: bytes) -> None:
        """Rank 0: forward a launch (or ``STOP``) to every other rank."""
        for s in self.peers:
            try:
                s.send(raw, zmq.NOBLOCK)  # a peer that left leaves PAIR nothing to queue into
            except zmq.Again:
                raise GroupBroken("a tensor-parallel peer is not reading its launches") from None

    def receive(self, timeout_ms: int) -> bytes | None:
        """Another rank: the next message from rank 0, or None after ``timeout_ms``."""
        if self.sock.poll(timeout_ms):
            return self.sock.recv()
        return None

    def close(self) -> None:
        import torch.distributed as dist

        for s in [*self.peers, *([self.sock] if self.sock is not None else [])]:
            s.close(0)
        if dist.is_initialized():
            dist.destroy_process_group()


def _alive(pid: int) -> bool:
    """Whether a process runs (a killed one may linger as a zombie until its parent reaps it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")

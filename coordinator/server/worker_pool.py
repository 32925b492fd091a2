"""The coordinator's worker actors: start, attach, watch for death, replace, drain, stop.

Each worker gets its own arena banks and ``EngineCore`` (over a ``SocketExecutor``) here; with
the offline engine, this is the only coordinator module that imports ``worker/``.
Death is seen from the step socket, not from Ray: the coordinator's PAIR socket
carries a monitor (a process that dies closes its TCP connection at once) and ZMTP
heartbeats (a host that vanishes stops answering them), so a lost worker is noticed
in milliseconds to about a second, and a launch that outlives ``step_timeout_s``
counts as a hung worker. What to do with a lost worker's requests is the server's
business.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import zmq
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from zmq.utils.monitor import recv_monitor_message

from fusedserve.coordinator.engine.engine_core import EngineCore
from fusedserve.coordinator.engine.scheduler import Scheduler
from fusedserve.coordinator.engine.sequence import Sequence
from fusedserve.coordinator.engine.socket_executor import SocketExecutor
from fusedserve.coordinator.server.core_slots import CoreSlots
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.contract import HEARTBEAT_TIMEOUT_MS, heartbeat_interval_ms
from fusedserve.shared_memory.engine_config import EngineConfig
from fusedserve.shared_memory.slots import step_table
from fusedserve.worker.actor import WorkerActor
from fusedserve.worker.device import DeviceInfo
from fusedserve.worker.device import probe as probe_device  # noqa: F401 - the server's one way to the device probe
from fusedserve.worker.tensor_group import GroupRank

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0


@dataclass
class WorkerHandle:
    worker_id: str
    group: WorkerGroup
    core: EngineCore
    executor: SocketExecutor
    monitor: zmq.Socket
    info: dict
    draining: bool = False

    @property
    def actor(self) -> Any:
        """The actor that owns the step socket (rank 0 of a tensor-parallel group)."""
        return self.group.actors[0]

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def arenas(self) -> list[HostArena]:
        return self.core.arenas

    @property
    def sock(self) -> zmq.Socket:
        return self.executor.sock

    @property
    def serial(self) -> bool:
        return self.executor.serial

    def lost(self) -> bool:
        """True when the step socket's peer has disconnected (drains the monitor)."""
        gone = False
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            gone = gone or event["event"] in (zmq.EVENT_DISCONNECTED, zmq.EVENT_MONITOR_STOPPED)
        return gone


@dataclass
class WorkerGroup:
    """A worker's actors: one, or a tensor-parallel group's ranks in their placement group."""

    actors: list[Any]
    placement: Any = None  # the group's placement group (tensor parallel), removed with it
    cores: list[int | None] = field(default_factory=list)  # each rank's core group (CoreSlots)

    def kill(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self.placement is not None:
            try:
                ray.util.remove_placement_group(self.placement)
            except Exception:  # noqa: BLE001 - already removed
                pass
            self.placement = None


@dataclass
class Starting:
    """A worker whose start calls (one per rank) are still running."""

    worker_id: str
    group: WorkerGroup
    arenas: list[HostArena]
    refs: list[Any]
    epoch: int

    def close(self) -> None:
        for arena in self.arenas:
            arena.close()


@dataclass
class Failure:
    worker_id: str
    reason: str
    at: float
    requests: int  # unfinished requests it held, all re-run elsewhere


@dataclass
class PoolConfig:
    engine: EngineConfig  # resolved: every worker loads exactly this
    device: DeviceInfo  # probed once, by the server
    serial: bool
    step_timeout_s: float
    max_restarts: int  # replacements allowed per restart_window_s
    restart_window_s: float = 60.0
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS  # the step socket's, on both of its ends


class WorkerPool:
    def __init__(self, ctx: zmq.Context, cfg: PoolConfig, model: Qwen3Config,
                 new_core: Callable[[list[HostArena], SocketExecutor], EngineCore]):
        self.ctx = ctx
        self.cfg = cfg
        self.device = cfg.device
        self.table = step_table()
        self.banks = cfg.engine.banks
        self.max_dims = cfg.engine.max_dims(model.vocab_size)
        self.new_core = new_core
        self.workers: list[WorkerHandle] = []
        self.starting: list[Starting] = []
        self.stopping: list[tuple[WorkerGroup, list[Any], float]] = []
        self.failures: list[Failure] = []
        self.retired_tokens = 0  # generated by workers no longer in the pool (the rest: their cores)
        self.retired_fenced = 0  # frames their executors fenced
        p = cfg.engine.parallel
        ranks = max(p.workers, 1) * p.tensor_parallel_size  # on this node, as far as the pool can tell
        self.cores = CoreSlots(ranks, cfg.engine.device.threads_per_worker)
        self._restarts: deque[float] = deque()
        self._next_id = 0

    @property
    def active(self) -> list[WorkerHandle]:
        return [w for w in self.workers if not w.draining]

    def device_slots(self) -> int:
        """Workers for ``--workers auto``: every NPU/GPU the cluster reports, else one per node."""
        res = ray.cluster_resources()
        key = {"npu": "NPU", "cuda": "GPU"}.get(self.device.kind)
        size = self.cfg.engine.parallel.tensor_parallel_size
        if key is not None:
            return max(1, int(res.get(key, 0)) // size)
        return max(1, sum(1 for node in ray.nodes() if node.get("Alive")) // size)

    def spawn(self) -> None:
        """Create a worker's actors (a group's ranks, placed on one node) and its arena banks;
        the start calls run in the background."""
        epoch = self._next_id  # this incarnation's: never reused, so a replaced worker's frames are fenced
        wid = f"w{epoch}"
        self._next_id += 1
        arenas = [HostArena.create(self.table, self.max_dims, tag=wid) for _ in range(self.banks)]
        engine = self.cfg.engine
        size = engine.parallel.tensor_parallel_size
        options = self.device.ray_resources(engine.device.cpus_per_worker)
        group = WorkerGroup([])
        placements: list[dict] = [{}]
        if size > 1:  # every rank on one node: they share the arena banks and loopback sockets
            group.placement = ray.util.placement_group([_bundle(options)] * size, strategy="STRICT_PACK")
            placements = [{"scheduling_strategy": PlacementGroupSchedulingStrategy(
                group.placement, placement_group_bundle_index=r)} for r in range(size)]
        for placement in placements:
            slot, cores = self.cores.take()
            group.cores.append(slot)
            group.actors.append(ray.remote(WorkerActor).options(max_concurrency=2, **options, **placement)
                                .remote(wid, self.device.kind, self.cores.threads, cores, epoch,
                                        self.cfg.heartbeat_timeout_ms))
        # A worker on another node cannot attach the arena and falls back to the serializing
        # transport by itself; the serial option forces that path here too.
        names = [None if self.cfg.serial else a.name for a in arenas]
        # Rank 0 names the address the ranks meet at; Ray hands its result to every start call.
        meet = group.actors[0].rendezvous.remote() if size > 1 else None
        expert_parallel, timeout = engine.parallel.enable_expert_parallel, self.cfg.step_timeout_s
        refs = [actor.start.remote(engine, names, rendezvous=meet,
                                   rank=GroupRank(r, size, expert_parallel, timeout))
                for r, actor in enumerate(group.actors)]
        self.starting.append(Starting(wid, group, arenas, refs, epoch))

    def start(self, n: int) -> None:
        """Start ``n`` workers and wait for all of them (the server's first start)."""
        for _ in range(n):
            self.spawn()
        for starting in list(self.starting):
            self.starting.remove(starting)
            self._attach(starting, ray.get(starting.refs))

    def _attach(self, starting: Starting, infos: list[dict]) -> WorkerHandle:
        info = {**infos[0], "ranks": [{"pid": i["pid"], "device": i["device"]} for i in infos]}
        sock = self.ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_interval_ms(self.cfg.heartbeat_timeout_ms))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.cfg.heartbeat_timeout_ms)
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # a worker's endpoint is never reused
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(info["endpoint"])
        executor = SocketExecutor(sock, starting.arenas, serial=info["transport"] == "serial",
                                  epoch=starting.epoch)
        w = WorkerHandle(starting.worker_id, starting.group, self.new_core(starting.arenas, executor),
                         executor, monitor, info)
        self.workers.append(w)
        log.info("worker %s up: %s", w.worker_id, info)
        return w

    def poll_starting(self) -> None:
        """Attach the workers whose start finished; a failed start is replaced if allowed."""
        for starting in list(self.starting):
            _, pending = ray.wait(starting.refs, num_returns=len(starting.refs), timeout=0)
            failed = [ref for ref in starting.refs if ref not in pending and _failed(ref)]
            if pending and not failed:
                continue
            self.starting.remove(starting)
            try:
                self._attach(starting, ray.get(starting.refs))
            except Exception as exc:  # noqa: BLE001 - a failed start must not take the server down
                log.error("worker %s failed to start: %s", starting.worker_id, exc)
                self._end(starting.group)
                starting.close()
                self.failures.append(Failure(starting.worker_id, f"start failed: {exc}", time.time(), 0))
                self._replace(starting.worker_id)

    def find_lost(self, ready: dict) -> list[tuple[WorkerHandle, str]]:
        """Workers whose socket peer left, or whose launch outlived ``step_timeout_s``."""
        lost = []
        now = time.perf_counter()
        for w in self.workers:
            if w.monitor in ready and w.lost():
                lost.append((w, "step socket disconnected (process gone or heartbeats unanswered)"))
            elif w.core.inflight and now - w.core.running_since > self.cfg.step_timeout_s:
                lost.append((w, f"launch ran over {self.cfg.step_timeout_s:.0f} s (hung)"))
        return lost

    def remove_lost(self, w: WorkerHandle, reason: str) -> list[Sequence]:
        """Drop a dead or hung worker; return its unfinished requests and start a replacement."""
        seqs = w.core.unfinished()
        log.error("worker %s lost: %s; re-running %d requests", w.worker_id, reason, len(seqs))
        self.workers.remove(w)
        self.failures.append(Failure(w.worker_id, reason, time.time(), len(seqs)))
        self._end(w.group)
        self._close(w)
        if not w.draining:
            self._replace(w.worker_id)
        return seqs

    def _replace(self, worker_id: str) -> None:
        now = time.monotonic()
        while self._restarts and now - self._restarts[0] > self.cfg.restart_window_s:
            self._restarts.popleft()
        if len(self._restarts) >= self.cfg.max_restarts:
            log.error("not replacing %s: %d restarts in %.0f s", worker_id, len(self._restarts),
                      self.cfg.restart_window_s)
            return
        self._restarts.append(now)
        self.spawn()

    def retire(self, w: WorkerHandle) -> None:
        """Stop a drained worker without waiting on it: ask, then kill once it answered."""
        self.workers.remove(w)
        refs = [actor.stop.remote() for actor in w.group.actors]
        self.stopping.append((w.group, refs, time.monotonic() + STOP_GRACE_S))
        self._close(w)

    def poll_stopping(self) -> None:
        for entry in list(self.stopping):
            group, refs, deadline = entry
            _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
            if not pending or time.monotonic() > deadline:
                self.stopping.remove(entry)
                self._end(group)

    def shutdown(self) -> None:
        """Stop every worker (in parallel, bounded wait), close sockets, unlink arenas."""
        refs = []
        for w in self.workers:
            for actor in w.group.actors:
                try:
                    refs.append(actor.stop.remote())
                except Exception:  # noqa: BLE001 - the worker may already be gone
                    pass
        try:
            ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S)
        except Exception:  # noqa: BLE001
            log.warning("workers did not all stop cleanly")
        for w in self.workers:
            self._end(w.group)
            self._close(w)
        self.workers.clear()
        for starting in self.starting:
            self._end(starting.group)
            starting.close()
        self.starting.clear()
        for group, _, _ in self.stopping:
            self._end(group)
        self.stopping.clear()

    def sockets(self) -> list[zmq.Socket]:
        """What the server's loop polls: every monitor, and the step socket of a busy worker."""
        return [*(w.monitor for w in self.workers), *(w.sock for w in self.workers if not w.core.idle)]

    def busy(self) -> bool:
        """Something for ``service`` to do: starts, stops or drains in progress."""
        return bool(self.starting or self.stopping or any(w.draining for w in self.workers))

    def service(self) -> None:
        """Attach started workers, reap stopped ones, retire drained ones that went idle."""
        self.poll_starting()
        self.poll_stopping()
        for w in list(self.workers):
            if w.draining and w.core.idle and not w.core.has_work():
                self.retire(w)
                log.info("worker %s drained and stopped", w.worker_id)

    def _end(self, group: WorkerGroup) -> None:
        """Kill a group's actors and give their core groups back (idempotent)."""
        group.kill()
        for slot in group.cores:
            self.cores.give(slot)
        group.cores = []

    def _close(self, w: WorkerHandle) -> None:
        self.retired_tokens += w.core.stats.tokens
        self.retired_fenced += w.executor.fenced
        w.sock.disable_monitor()
        w.monitor.close(0)
        w.sock.close(0)
        for arena in w.arenas:
            arena.close()


def _bundle(options: dict) -> dict:
    """A placement-group bundle holding what ``options`` (an actor's resources) ask for."""
    bundle = {"CPU": options.get("num_cpus", 1), **options.get("resources", {})}
    if options.get("num_gpus"):
        bundle["GPU"] = options["num_gpus"]
    return bundle


def _failed(ref: Any) -> bool:
    """Whether a finished start call raised (one failed rank fails its group's start at once)."""
    try:
        ray.get(ref, timeout=0)
        return False
    except Exception:  # noqa: BLE001 - any error of the call
        return True

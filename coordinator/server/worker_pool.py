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
from dataclasses import dataclass
from typing import Any

import ray
import zmq
from zmq.utils.monitor import recv_monitor_message

from coordinator.engine.engine_core import EngineCore
from coordinator.engine.executor import SocketExecutor
from coordinator.engine.scheduler import Scheduler
from coordinator.engine.sequence import Sequence
from kernels.model.config import Qwen3Config
from shared_memory.arena import HostArena
from shared_memory.contract import RunnerConfig
from shared_memory.slots import step_table
from worker.actor import WorkerActor
from worker.device import DeviceInfo, probe

log = logging.getLogger(__name__)

HEARTBEAT_IVL_MS = 200
HEARTBEAT_TIMEOUT_MS = 600
STOP_GRACE_S = 10.0


@dataclass
class WorkerHandle:
    worker_id: str
    actor: Any
    core: EngineCore
    executor: SocketExecutor
    monitor: zmq.Socket
    info: dict
    draining: bool = False

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
class Starting:
    """A worker whose start call is still running."""

    worker_id: str
    actor: Any
    arenas: list[HostArena]
    ref: Any

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
    device: str  # auto | cpu | cuda | npu: probed once, when the pool is made
    model_dir: str
    dtype: str | None
    quantization: str | None
    max_model_len: int
    runner: RunnerConfig
    cpus_per_worker: int
    threads_per_worker: int
    serial: bool
    step_timeout_s: float
    max_restarts: int  # replacements allowed per restart_window_s
    restart_window_s: float = 60.0


class WorkerPool:
    def __init__(self, ctx: zmq.Context, cfg: PoolConfig, model: Qwen3Config,
                 new_core: Callable[[list[HostArena], SocketExecutor], EngineCore]):
        self.ctx = ctx
        self.cfg = cfg
        self.device: DeviceInfo = probe(cfg.device)
        self.table = step_table()
        self.banks = cfg.runner.banks
        self.max_dims = cfg.runner.max_dims(model.vocab_size, cfg.max_model_len)
        self.new_core = new_core
        self.workers: list[WorkerHandle] = []
        self.starting: list[Starting] = []
        self.stopping: list[tuple[Any, Any, float]] = []
        self.failures: list[Failure] = []
        self._restarts: deque[float] = deque()
        self._next_id = 0

    @property
    def active(self) -> list[WorkerHandle]:
        return [w for w in self.workers if not w.draining]

    def device_slots(self) -> int:
        """Workers for ``--workers auto``: every NPU/GPU the cluster reports, else one per node."""
        res = ray.cluster_resources()
        key = {"npu": "NPU", "cuda": "GPU"}.get(self.device.kind)
        if key is not None:
            return max(1, int(res.get(key, 0)))
        return max(1, sum(1 for node in ray.nodes() if node.get("Alive")))

    def spawn(self) -> None:
        """Create a worker actor and its arena banks; the start call runs in the background."""
        wid = f"w{self._next_id}"
        self._next_id += 1
        arenas = [HostArena.create(self.table, self.max_dims, tag=wid) for _ in range(self.banks)]
        options = self.device.ray_resources(self.cfg.cpus_per_worker)
        actor = ray.remote(WorkerActor).options(max_concurrency=2, **options).remote(
            wid, self.device.kind, self.cfg.threads_per_worker)
        # A worker on another node cannot attach the arena and falls back to the serializing
        # transport by itself; the serial option forces that path here too.
        names = [None if self.cfg.serial else a.name for a in arenas]
        ref = actor.start.remote(self.cfg.model_dir, self.cfg.dtype, self.cfg.max_model_len,
                                 self.cfg.runner, names, quantization=self.cfg.quantization)
        self.starting.append(Starting(wid, actor, arenas, ref))

    def start(self, n: int) -> None:
        """Start ``n`` workers and wait for all of them (the server's first start)."""
        for _ in range(n):
            self.spawn()
        for starting in list(self.starting):
            self.starting.remove(starting)
            self._attach(starting, ray.get(starting.ref))

    def _attach(self, starting: Starting, info: dict) -> WorkerHandle:
        sock = self.ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # a worker's endpoint is never reused
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(info["endpoint"])
        executor = SocketExecutor(sock, starting.arenas, serial=info["transport"] == "serial")
        w = WorkerHandle(starting.worker_id, starting.actor, self.new_core(starting.arenas, executor),
                         executor, monitor, info)
        self.workers.append(w)
        log.info("worker %s up: %s", w.worker_id, info)
        return w

    def poll_starting(self) -> None:
        """Attach the workers whose start finished; a failed start is replaced if allowed."""
        for starting in list(self.starting):
            ready, _ = ray.wait([starting.ref], timeout=0)
            if not ready:
                continue
            self.starting.remove(starting)
            try:
                self._attach(starting, ray.get(starting.ref))
            except Exception as exc:  # noqa: BLE001 - a failed start must not take the server down
                log.error("worker %s failed to start: %s", starting.worker_id, exc)
                self._kill(starting.actor)
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
        self._kill(w.actor)
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
        self.stopping.append((w.actor, w.actor.stop.remote(), time.monotonic() + STOP_GRACE_S))
        self._close(w)

    def poll_stopping(self) -> None:
        for entry in list(self.stopping):
            actor, ref, deadline = entry
            ready, _ = ray.wait([ref], timeout=0)
            if ready or time.monotonic() > deadline:
                self.stopping.remove(entry)
                self._kill(actor)

    def shutdown(self) -> None:
        """Stop every worker (in parallel, bounded wait), close sockets, unlink arenas."""
        refs = []
        for w in self.workers:
            try:
                refs.append(w.actor.stop.remote())
            except Exception:  # noqa: BLE001 - the worker may already be gone
                pass
        try:
            ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE_S)
        except Exception:  # noqa: BLE001
            log.warning("workers did not all stop cleanly")
        for w in self.workers:
            self._kill(w.actor)
            self._close(w)
        self.workers.clear()
        for starting in self.starting:
            self._kill(starting.actor)
            starting.close()
        self.starting.clear()
        for actor, _, _ in self.stopping:
            self._kill(actor)
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

    @staticmethod
    def _kill(actor: Any) -> None:
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass

    @staticmethod
    def _close(w: WorkerHandle) -> None:
        w.sock.disable_monitor()
        w.monitor.close(0)
        w.sock.close(0)
        for arena in w.arenas:
            arena.close()

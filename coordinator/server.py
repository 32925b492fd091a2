"""The coordinator: request queue, one arena + scheduler per worker, ZeroMQ front end.

One thread runs the loop: read client frames, start a launch on every idle worker
that has work (a descriptor on its PAIR socket; tensors in its arena), and turn
each finished launch into tokens for the clients. Workers run their launches in
parallel; the loop never waits on one worker while another has a reply ready.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import msgpack
import ray
import zmq

from coordinator import protocol
from coordinator.batch_io import read_result, write_batch
from coordinator.protocol import ControlRequest, GenerateRequest, ProtocolError
from coordinator.scheduler import RequestError, Scheduler, Sequence, StepBatch, TokenEvent
from kernels.config import Qwen3Config
from kernels.default_model import resolve_model
from kernels.kv_cache import BlockManager
from kernels.tokenizer import TextTokenizer
from shared_memory import transport
from shared_memory.arena import HostArena, remove_stale
from shared_memory.slots import decode_table, prefill_table
from worker.actor import WorkerActor
from worker.device import probe
from worker.model_runner import LaunchDescriptor, RunnerConfig, launch_max_dims

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    model: str = "default"
    workers: int = 1
    device: str = "auto"
    host: str = "127.0.0.1"
    port: int = 5557
    dtype: str | None = None
    max_model_len: int | None = 1024
    runner: RunnerConfig = field(default_factory=RunnerConfig)
    cpus_per_worker: int = 1
    threads_per_worker: int = 1
    step_timeout_s: float = 60.0
    # "auto": shared memory for workers on this node, serializing for others; "serial" forces it.
    transport: str = "auto"


@dataclass
class Pending:
    """A client request: who asked, under which id, and its timings."""

    identity: bytes
    client_id: Any
    stream: bool
    seq: Sequence
    worker: WorkerHandle
    t_arrival: float
    t_first: float | None = None


@dataclass
class WorkerHandle:
    worker_id: str
    actor: Any
    arena: HostArena
    scheduler: Scheduler
    sock: zmq.Socket
    info: dict
    inflight: tuple[StepBatch, LaunchDescriptor, float] | None = None
    steps: int = 0
    tokens: int = 0
    last_decode: dict | None = None
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    serial: bool = False
    wire_bytes: int = 0
    kernel_s: float = 0.0
    # Recent decode steps as (batch, coordinator wall s, worker launch s): the overhead figure.
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))
    draining: bool = False


@dataclass
class Starting:
    """A worker whose start call is still running."""

    worker_id: str
    actor: Any
    arena: HostArena
    ref: Any


class Coordinator:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.model_dir = str(resolve_model(cfg.model))
        self.config = Qwen3Config.from_dir(self.model_dir)
        self.tokenizer = TextTokenizer.from_dir(self.model_dir)
        mml = min(cfg.max_model_len or self.config.max_position_embeddings,
                  self.config.max_position_embeddings)
        self.max_model_len = mml
        self.max_dims = launch_max_dims(cfg.runner, self.config.vocab_size, self.config.hidden_size, mml)
        # HOST_SHARED layout does not depend on the model dtype (only DEVICE_RESIDENT slots do).
        self.tables = {t.name: t for t in (prefill_table(), decode_table())}
        self.ctx = zmq.Context()
        self.workers: list[WorkerHandle] = []
        self.pending: dict[str, Pending] = {}
        self.by_client: dict[tuple[bytes, Any], str] = {}
        self._ids = itertools.count()
        self._worker_ids = itertools.count()
        self.starting: list[Starting] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_at = time.time()
        self.completed = 0
        self.frontend: zmq.Socket | None = None
        self.address = f"tcp://{cfg.host}:{cfg.port}"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        remove_stale()
        if self.cfg.transport not in ("auto", "serial"):
            raise ValueError(f"transport must be auto or serial, got {self.cfg.transport!r}")
        self.device = probe(self.cfg.device)
        n = self.cfg.workers if self.cfg.workers > 0 else self.device_slots()
        for starting in [self._spawn() for _ in range(n)]:
            self._attach(starting, ray.get(starting.ref))
        self.frontend = self.ctx.socket(zmq.ROUTER)
        self.frontend.setsockopt(zmq.LINGER, 0)
        self.frontend.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
        self.frontend.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if self.cfg.port == 0:
            port = self.frontend.bind_to_random_port(f"tcp://{self.cfg.host}")
            self.address = f"tcp://{self.cfg.host}:{port}"
        else:
            self.frontend.bind(self.address)
        log.info("coordinator serving on %s with %d %s workers", self.address, n, self.device.kind)

    def device_slots(self) -> int:
        """Workers for ``--workers auto``: every NPU/GPU the cluster reports, else one per node."""
        res = ray.cluster_resources()
        key = {"npu": "NPU", "cuda": "GPU"}.get(self.device.kind)
        if key is not None:
            return max(1, int(res.get(key, 0)))
        return max(1, sum(1 for node in ray.nodes() if node.get("Alive")))

    def _spawn(self) -> Starting:
        """Create a worker actor and its arena; the start call runs in the background."""
        wid = f"w{next(self._worker_ids)}"
        arena = HostArena.create(list(self.tables.values()), self.max_dims, tag=wid)
        options = self.device.ray_resources(self.cfg.cpus_per_worker)
        actor = ray.remote(WorkerActor).options(max_concurrency=2, **options).remote(
            wid, self.device.kind, self.cfg.threads_per_worker)
        # A worker on another node cannot attach the arena and falls back to the serializing
        # transport by itself; "serial" forces that path here too.
        name = None if self.cfg.transport == "serial" else arena.name
        ref = actor.start.remote(self.model_dir, self.cfg.dtype, self.max_model_len,
                                 vars(self.cfg.runner), name)
        return Starting(wid, actor, arena, ref)

    def _attach(self, starting: Starting, info: dict) -> WorkerHandle:
        sock = self.ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(info["endpoint"])
        w = WorkerHandle(starting.worker_id, starting.actor, starting.arena, self._new_scheduler(), sock,
                         info, serial=info["transport"] == "serial")
        self.workers.append(w)
        log.info("worker %s up: %s", w.worker_id, info)
        return w

    # -------------------------------------------------------------------- scaling

    def scale(self, n: int) -> dict:
        """Grow to ``n`` workers (started in the background) or shrink by draining the newest."""
        active = [w for w in self.workers if not w.draining]
        total = len(active) + len(self.starting)
        for _ in range(n - total):
            self.starting.append(self._spawn())
        for w in reversed(active[n:] if n < len(active) else []):
            self._drain(w)
        return {"active": min(n, len(active)), "starting": len(self.starting),
                "draining": sum(w.draining for w in self.workers)}

    def _drain(self, w: WorkerHandle) -> None:
        """Stop routing to ``w``; its not-yet-started requests move now, running ones finish there."""
        w.draining = True
        others = [o for o in self.workers if not o.draining]
        if not others:
            return
        while w.scheduler.waiting:
            seq = w.scheduler.waiting.pop()
            target = min(others, key=lambda o: o.scheduler.load)
            target.scheduler.resume(seq)
            self.pending[seq.seq_id].worker = target

    def _service_workers(self) -> None:
        for starting in list(self.starting):
            ready, _ = ray.wait([starting.ref], timeout=0)
            if ready:
                self.starting.remove(starting)
                try:
                    self._attach(starting, ray.get(starting.ref))
                except Exception:  # noqa: BLE001 - a failed start must not take the server down
                    log.exception("worker %s failed to start", starting.worker_id)
                    starting.arena.close()
        for w in list(self.workers):
            if w.draining and w.inflight is None and not w.scheduler.has_work():
                self.workers.remove(w)
                self._stop_worker(w)
                log.info("worker %s drained and stopped", w.worker_id)

    def _stop_worker(self, w: WorkerHandle) -> None:
        try:
            ray.get(w.actor.stop.remote(), timeout=10)
            ray.kill(w.actor)
        except Exception:  # noqa: BLE001 - the worker may already be gone
            log.warning("worker %s did not stop cleanly", w.worker_id)
        w.sock.close(0)
        w.arena.close()

    def _new_scheduler(self) -> Scheduler:
        rc = self.cfg.runner
        return Scheduler(BlockManager(rc.num_blocks, rc.block_size), self.config.vocab_size,
                         self.max_model_len, rc.max_batch, rc.top_k, self.config.eos_token_ids,
                         rc.max_prefill_tokens,
                         self.tokenizer.decode if self.tokenizer else None)

    def serve_in_thread(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, daemon=True, name="coordinator")
        self._thread.start()

    def serve_forever(self) -> None:
        try:
            while not self._stop.is_set():
                self.loop_once()
        except Exception:
            log.exception("coordinator loop crashed")
            raise

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for p in list(self.pending.values()):
            self._send(p.identity, protocol.error(p.client_id, "shutdown", "server is shutting down"))
        self.pending.clear()
        for w in self.workers:
            self._stop_worker(w)
        self.workers.clear()
        for starting in self.starting:
            ray.kill(starting.actor)
            starting.arena.close()
        self.starting.clear()
        if self.frontend is not None:
            self.frontend.close(0)
        self.ctx.term()

    # ----------------------------------------------------------------------- loop

    def loop_once(self) -> None:
        if self.starting or any(w.draining for w in self.workers):
            self._service_workers()
        for w in self.workers:
            if w.inflight is None and w.scheduler.has_work():
                self._launch(w)
        poller = zmq.Poller()
        poller.register(self.frontend, zmq.POLLIN)
        for w in self.workers:
            if w.inflight is not None:
                poller.register(w.sock, zmq.POLLIN)
        ready = dict(poller.poll(50))
        for w in self.workers:
            if w.inflight is not None and w.sock in ready:
                raw = w.sock.recv()
                w.wire_bytes += len(raw)
                self._finish(w, msgpack.unpackb(raw, raw=False))
        if self.frontend in ready:
            for _ in range(256):  # bounded so a flood cannot starve the workers
                try:
                    identity, *frames = self.frontend.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(identity, frames[-1] if frames else b"")

    def _launch(self, w: WorkerHandle) -> None:
        t0 = time.perf_counter()
        batch = w.scheduler.schedule()
        if batch is None:
            return
        desc = write_batch(w.arena, batch, w.scheduler.steps, self.cfg.runner.top_k,
                           self.config.vocab_size, self.config.hidden_size)
        msg = desc.to_wire()
        if w.serial:
            msg["inputs"] = transport.pack_inputs(w.arena, self.tables[desc.table], desc.dims)
        payload = msgpack.packb(msg)
        w.wire_bytes += len(payload)
        w.sock.send(payload)
        w.inflight = (batch, desc, t0)

    def _finish(self, w: WorkerHandle, reply: dict) -> None:
        batch, desc, t0 = w.inflight
        w.inflight = None
        if not reply.get("ok"):
            log.error("worker %s launch failed: %s", w.worker_id, reply.get("error"))
            for seq in batch.seqs:
                self._fail(seq.seq_id, "worker_error", reply.get("error", "launch failed"))
            return
        if w.serial:
            transport.unpack(w.arena, self.tables[desc.table], desc.dims, reply["outputs"], outputs=True)
        w.steps += 1
        w.h2d_bytes += reply["h2d"]
        w.d2h_bytes += reply["d2h"]
        if desc.table == "decode":
            w.last_decode = {"batch": desc.dims["B"], "h2d": reply["h2d"], "d2h": reply["d2h"],
                             "seconds": reply["seconds"]}
        events = w.scheduler.process(batch, read_result(w.arena, desc))
        w.tokens += len(events)
        for ev in events:
            self._emit(ev)
        w.kernel_s += reply["seconds"]
        if desc.table == "decode":
            w.recent.append((desc.dims["B"], time.perf_counter() - t0, reply["seconds"]))

    # ------------------------------------------------------------------- requests

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            req = protocol.parse(frame)
        except ProtocolError as exc:
            self._send(identity, protocol.error(exc.request_id, exc.code, str(exc)))
            return
        try:
            if isinstance(req, GenerateRequest):
                self._generate(identity, req)
            else:
                self._control(identity, req)
        except (RequestError, ProtocolError) as exc:
            self._send(identity, protocol.error(req.id, exc.code, str(exc)))
        except Exception as exc:  # noqa: BLE001 - never let one request take the server down
            log.exception("request %r failed", req.id)
            self._send(identity, protocol.error(req.id, "internal", f"{type(exc).__name__}: {exc}"))

    def _generate(self, identity: bytes, req: GenerateRequest) -> None:
        key = (identity, req.id)
        if key in self.by_client:
            raise ProtocolError("duplicate_id", f"request id {req.id!r} is already in flight", req.id)
        if req.prompt is not None:
            if self.tokenizer is None:
                raise ProtocolError("no_tokenizer", "this model has no tokenizer: send prompt_ids", req.id)
            prompt_ids = self.tokenizer.encode(req.prompt)
        else:
            prompt_ids = req.prompt_ids
        w = min((h for h in self.workers if not h.draining), key=lambda h: h.scheduler.load)
        seq_id = f"r{next(self._ids)}"
        seq = w.scheduler.add(seq_id, prompt_ids, req.params)
        self.pending[seq_id] = Pending(identity, req.id, req.stream, seq, w, time.perf_counter())
        self.by_client[key] = seq_id

    def _control(self, identity: bytes, req: ControlRequest) -> None:
        if req.type == "abort":
            seq_id = self.by_client.get((identity, req.target))
            if seq_id is None:
                raise ProtocolError("not_found", f"no request {req.target!r} in flight", req.id)
            p = self.pending[seq_id]
            p.worker.scheduler.abort(seq_id)
            p.seq.finish_reason = "abort"
            self._done(p)
            if req.id != req.target:
                self._send(identity, {"type": "done", "id": req.id, "aborted": req.target})
        elif req.type == "scale":
            self._send(identity, {"type": "scale", "id": req.id, **self.scale(req.target)})
        elif req.type == "stats":
            self._send(identity, {"type": "stats", "id": req.id, **self.stats()})
        elif req.type == "health":
            self._send(identity, {"type": "health", "id": req.id, "ok": True,
                                  "workers": len(self.workers)})
        elif req.type == "workers":
            self._send(identity, {"type": "workers", "id": req.id, "workers": [
                {"id": w.worker_id, **w.info} for w in self.workers]})

    def _emit(self, ev: TokenEvent) -> None:
        p = self.pending.get(ev.seq.seq_id)
        if p is None:
            return
        if p.t_first is None:
            p.t_first = time.perf_counter()
        if p.stream:
            self._send(p.identity, {"type": "token", "id": p.client_id, "token": ev.token,
                                    "index": len(ev.seq.output_ids) - 1})
        if ev.finished:
            self._done(p)

    def _done(self, p: Pending) -> None:
        seq = p.seq
        self.pending.pop(seq.seq_id, None)
        self.by_client.pop((p.identity, p.client_id), None)
        self.completed += 1
        text = seq.text
        if self.tokenizer is not None and not seq.params.stop:
            text = self.tokenizer.decode(seq.output_ids)
        now = time.perf_counter()
        msg = {
            "type": "done", "id": p.client_id, "text": text, "token_ids": list(seq.output_ids),
            "finish_reason": seq.finish_reason or "abort",
            "usage": {"prompt_tokens": len(seq.prompt_ids), "completion_tokens": len(seq.output_ids)},
            "timings": {"ttft_s": (p.t_first or now) - p.t_arrival, "total_s": now - p.t_arrival},
        }
        if seq.params.logprobs:
            msg["logprobs"] = list(seq.logprobs)
        self._send(p.identity, msg)

    def _fail(self, seq_id: str, code: str, message: str) -> None:
        p = self.pending.pop(seq_id, None)
        if p is None:
            return
        p.worker.scheduler.abort(seq_id)
        self.by_client.pop((p.identity, p.client_id), None)
        self._send(p.identity, protocol.error(p.client_id, code, message))

    def _send(self, identity: bytes, msg: dict) -> None:
        try:
            self.frontend.send_multipart([identity, protocol.pack(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("dropping reply to a client: %s", exc)

    # ---------------------------------------------------------------------- stats

    def stats(self) -> dict:
        elapsed = max(time.time() - self.started_at, 1e-9)
        workers = []
        for w in self.workers:
            b = w.scheduler.blocks
            workers.append({
                "id": w.worker_id, "draining": w.draining, "steps": w.steps, "tokens": w.tokens,
                "waiting": len(w.scheduler.waiting), "running": len(w.scheduler.running),
                "kv_blocks_used": b.num_used, "kv_blocks_free": b.num_free,
                "h2d_bytes": w.h2d_bytes, "d2h_bytes": w.d2h_bytes,
                "h2d_bytes_per_step": w.h2d_bytes / w.steps if w.steps else 0.0,
                "d2h_bytes_per_step": w.d2h_bytes / w.steps if w.steps else 0.0,
                "last_decode": w.last_decode, "launch_s": w.kernel_s,
                "transport": "serial" if w.serial else "shm", "wire_bytes": w.wire_bytes,
            })
        tokens = sum(w.tokens for w in self.workers)
        return {
            "queue_length": sum(len(w.scheduler.waiting) for w in self.workers),
            "running": sum(len(w.scheduler.running) for w in self.workers),
            "completed": self.completed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "uptime_s": elapsed, "workers": workers, "starting": len(self.starting),
        }

"""The coordinator: request queue, one arena + scheduler per worker, ZeroMQ front end.

One thread runs the loop: read client frames, start a launch on every idle worker
that has work (a descriptor on its PAIR socket; tensors in its arena), and turn
each finished launch into tokens for the clients. Workers run their launches in
parallel; the loop never waits on one worker while another has a reply ready, and
never blocks on a client (frontend.py).

Nothing is lost to a fault: a lost worker's unfinished requests are re-run on the
others (or on its replacement) from prompt + tokens so far, and because sampling is
seeded per (request, step) they continue exactly where they were. A client that
leaves, or stops reading, has its requests aborted and their KV blocks freed.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
import zmq

from coordinator import protocol
from coordinator.batch_io import read_result, write_batch
from coordinator.frontend import Delivery, Frontend
from coordinator.protocol import ControlRequest, GenerateRequest, ProtocolError
from coordinator.scheduler import RequestError, Scheduler, Sequence, TokenEvent
from coordinator.workers import PoolConfig, WorkerHandle, WorkerPool
from kernels.config import Qwen3Config
from kernels.default_model import resolve_model
from kernels.kv_cache import BlockManager
from kernels.tokenizer import TextTokenizer
from shared_memory import transport
from shared_memory.arena import remove_stale
from shared_memory.slots import decode_table, prefill_table
from worker.device import probe
from worker.model_runner import RunnerConfig, launch_max_dims

log = logging.getLogger(__name__)

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MIN_TOKEN_CHARS = 16


@dataclass
class Limits:
    """Bounds on what one request or one client may ask; each refusal has its own code."""

    max_prompt_chars: int = 1 << 16  # text prompts: tokenizing runs on the loop thread
    max_prompt_tokens: int | None = None  # None: max_model_len - 1
    max_tokens: int | None = None  # None: max_model_len
    max_requests_per_client: int = 256  # in flight per connection
    max_queued_requests: int = 4096  # in flight in all


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
    step_timeout_s: float = 60.0  # a launch running longer means a hung worker: replaced
    # "auto": shared memory for workers on this node, serializing for others; "serial" forces it.
    transport: str = "auto"
    max_restarts: int = 8  # worker replacements allowed per minute
    max_workers: int = 64  # the most a scale request may ask for
    send_hwm: int = 4096  # frames queued per client before it counts as not reading
    send_buffer_bytes: int = 0  # kernel send buffer per client (0: the OS default, autotuned)
    # Required for any bind beyond loopback; when set, every frame must carry it as "auth".
    auth_token: str | None = None
    limits: Limits = field(default_factory=Limits)


@dataclass
class Pending:
    """A client request: who asked, under which id, where it runs, and its timings."""

    identity: bytes
    client_id: Any
    stream: bool
    seq: Sequence
    worker: WorkerHandle | None  # None: waiting for a worker to come up
    t_arrival: float
    t_first: float | None = None


@dataclass
class FaultCounters:
    reruns: int = 0  # requests moved off a lost worker and re-run
    client_gone: int = 0  # requests aborted because their client disconnected
    slow_client: int = 0  # requests aborted because their client stopped reading
    unauthorized: int = 0  # frames refused for a missing or wrong token


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


class Coordinator:
    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.model_dir = str(resolve_model(cfg.model))
        self.config = Qwen3Config.from_dir(self.model_dir)
        self.tokenizer = TextTokenizer.from_dir(self.model_dir)
        mml = min(cfg.max_model_len or self.config.max_position_embeddings,
                  self.config.max_position_embeddings)
        self.max_model_len = mml
        lim = cfg.limits
        self.max_prompt_tokens = min(lim.max_prompt_tokens or mml - 1, mml - 1)
        self.max_tokens = min(lim.max_tokens or mml, mml)
        self.max_dims = launch_max_dims(cfg.runner, self.config.vocab_size, self.config.hidden_size, mml)
        # HOST_SHARED layout does not depend on the model dtype (only DEVICE_RESIDENT slots do).
        self.tables = {t.name: t for t in (prefill_table(), decode_table())}
        self.ctx = zmq.Context()
        self.pool: WorkerPool | None = None
        self.pending: dict[str, Pending] = {}
        self.by_client: dict[tuple[bytes, Any], str] = {}
        self.per_client: Counter[bytes] = Counter()
        self.orphans: deque[Sequence] = deque()  # requests with no live worker at the moment
        self._validator = self._new_scheduler()
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_at = time.time()
        self.completed = 0
        self.tokens = 0  # generated, over every worker that ever ran
        self.faults = FaultCounters()
        self.frontend: Frontend | None = None
        self.address = f"tcp://{cfg.host}:{cfg.port}"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        cfg = self.cfg
        if cfg.transport not in ("auto", "serial"):
            raise ValueError(f"transport must be auto or serial, got {cfg.transport!r}")
        if cfg.auth_token is not None and len(cfg.auth_token) < MIN_TOKEN_CHARS:
            raise ValueError(f"auth token must have at least {MIN_TOKEN_CHARS} characters")
        if cfg.host not in LOOPBACK and cfg.auth_token is None:
            raise ValueError(f"binding {cfg.host} (beyond loopback) requires an auth token")
        remove_stale()
        self.device = probe(cfg.device)
        pcfg = PoolConfig(self.model_dir, cfg.dtype, self.max_model_len, vars(cfg.runner),
                          cfg.cpus_per_worker, cfg.threads_per_worker, cfg.transport == "serial",
                          cfg.step_timeout_s, cfg.max_restarts)
        self.pool = WorkerPool(self.ctx, pcfg, self.device, list(self.tables.values()), self.max_dims,
                               self._new_scheduler)
        n = cfg.workers if cfg.workers > 0 else self.device_slots()
        self.pool.start(n)
        self.frontend = Frontend.bind(self.ctx, cfg.host, cfg.port, cfg.send_hwm,
                                      cfg.send_buffer_bytes)
        self.address = self.frontend.address
        log.info("coordinator serving on %s with %d %s workers", self.address, n, self.device.kind)

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.pool.workers if self.pool else []

    def device_slots(self) -> int:
        """Workers for ``--workers auto``: every NPU/GPU the cluster reports, else one per node."""
        import ray

        res = ray.cluster_resources()
        key = {"npu": "NPU", "cuda": "GPU"}.get(self.device.kind)
        if key is not None:
            return max(1, int(res.get(key, 0)))
        return max(1, sum(1 for node in ray.nodes() if node.get("Alive")))

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

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop the loop; every request still in flight gets a ``shutdown`` error."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for p in list(self.pending.values()):
            self._send(p.identity, protocol.error(p.client_id, "shutdown", "server is shutting down"))
        self.pending.clear()
        self.by_client.clear()
        self.orphans.clear()
        if self.pool is not None:
            self.pool.shutdown()
        if self.frontend is not None:
            self.frontend.close(linger_ms=1000)
        self.ctx.term()

    # -------------------------------------------------------------------- workers

    def scale(self, n: int) -> dict:
        """Grow to ``n`` workers (started in the background) or shrink by draining the newest."""
        if not 1 <= n <= self.cfg.max_workers:
            raise RequestError("bad_field", f"workers must be in [1, {self.cfg.max_workers}]")
        active = self.pool.active
        for _ in range(n - len(active) - len(self.pool.starting)):
            self.pool.spawn()
        for w in reversed(active[n:] if n < len(active) else []):
            self._drain(w)
        return {"active": min(n, len(active)), "starting": len(self.pool.starting),
                "draining": sum(w.draining for w in self.workers)}

    def _drain(self, w: WorkerHandle) -> None:
        """Stop routing to ``w``; its not-yet-started requests move now, running ones finish there."""
        w.draining = True
        if not self.pool.active:
            return
        moved = list(w.scheduler.waiting)
        w.scheduler.waiting.clear()
        self._place(moved)

    def _place(self, seqs: list[Sequence]) -> None:
        """Queue requests that already have a history (moved or re-run) ahead of new ones."""
        for seq in reversed(seqs):
            active = self.pool.active
            target = min(active, key=lambda o: o.scheduler.load) if active else None
            if target is None:
                self.orphans.appendleft(seq)
            else:
                target.scheduler.resume(seq)
            if seq.seq_id in self.pending:
                self.pending[seq.seq_id].worker = target

    def _worker_lost(self, w: WorkerHandle, reason: str) -> None:
        seqs = [s for s in self.pool.remove_lost(w, reason) if s.seq_id in self.pending]
        self.faults.reruns += len(seqs)
        self._place(seqs)

    def _service_workers(self) -> None:
        self.pool.poll_starting()
        self.pool.poll_stopping()
        for w in list(self.pool.workers):
            if w.draining and w.inflight is None and not w.scheduler.has_work():
                self.pool.retire(w)
                log.info("worker %s drained and stopped", w.worker_id)

    def _service_orphans(self) -> None:
        if self.pool.active:
            seqs = list(self.orphans)
            self.orphans.clear()
            self._place(seqs)
        elif not self.pool.starting:
            for seq in list(self.orphans):
                self._fail(seq.seq_id, "no_workers", "every worker failed and none could be restarted")
            self.orphans.clear()

    # ----------------------------------------------------------------------- loop

    def loop_once(self) -> None:
        pool, fe = self.pool, self.frontend
        if pool.busy():
            self._service_workers()
        if self.orphans:
            self._service_orphans()
        for w in list(pool.workers):
            if w.inflight is None and w.scheduler.has_work():
                self._launch(w)
        poller = zmq.Poller()
        poller.register(fe.sock, zmq.POLLIN)
        poller.register(fe.monitor, zmq.POLLIN)
        for w in pool.workers:
            poller.register(w.monitor, zmq.POLLIN)
            if w.inflight is not None:
                poller.register(w.sock, zmq.POLLIN)
        ready = dict(poller.poll(50))
        for w in list(pool.workers):
            if w.inflight is not None and w.sock in ready:
                raw = w.sock.recv()
                w.wire_bytes += len(raw)
                self._finish(w, msgpack.unpackb(raw, raw=False))
        for w, reason in pool.find_lost(ready):
            self._worker_lost(w, reason)
        if fe.monitor in ready:
            fe.peer_left()
        for identity in fe.probe({p.identity for p in self.pending.values()}):
            self._drop_client(identity, "client_gone")
        fe.flush_owed()
        if fe.sock in ready:
            for _ in range(256):  # bounded so a flood cannot starve the workers
                got = fe.recv()
                if got is None:
                    break
                self._handle(*got)

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
        try:
            w.sock.send(payload, zmq.NOBLOCK)  # PAIR with no peer would block: the worker is gone
        except zmq.Again:
            self._worker_lost(w, "step socket has no peer")
            return
        w.wire_bytes += len(payload)
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
        self.tokens += len(events)
        for ev in events:
            self._emit(ev)
        w.kernel_s += reply["seconds"]
        if desc.table == "decode":
            w.recent.append((desc.dims["B"], time.perf_counter() - t0, reply["seconds"]))

    # ------------------------------------------------------------------- requests

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            req = protocol.parse(frame, self.cfg.auth_token)
        except ProtocolError as exc:
            if exc.code == "unauthorized":
                self.faults.unauthorized += 1
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

    def _check_limits(self, identity: bytes, req: GenerateRequest) -> None:
        lim = self.cfg.limits
        if (identity, req.id) in self.by_client:
            raise ProtocolError("duplicate_id", f"request id {req.id!r} is already in flight", req.id)
        if self.per_client[identity] >= lim.max_requests_per_client:
            raise RequestError("too_many_requests",
                               f"this connection has {lim.max_requests_per_client} requests in flight "
                               "(max_requests_per_client); wait for one to finish")
        if len(self.pending) >= lim.max_queued_requests:
            raise RequestError("server_busy", f"{len(self.pending)} requests in flight; retry later")
        if req.prompt is not None and len(req.prompt) > lim.max_prompt_chars:
            raise RequestError("prompt_too_long", f"prompt has {len(req.prompt)} characters; "
                               f"the limit is {lim.max_prompt_chars}")
        if req.params.max_tokens > self.max_tokens:
            raise RequestError("max_tokens_too_large",
                               f"max_tokens is {req.params.max_tokens}; this server allows {self.max_tokens}")

    def _generate(self, identity: bytes, req: GenerateRequest) -> None:
        self._check_limits(identity, req)
        if req.prompt is not None:
            if self.tokenizer is None:
                raise ProtocolError("no_tokenizer", "this model has no tokenizer: send prompt_ids", req.id)
            prompt_ids = self.tokenizer.encode(req.prompt)
        else:
            prompt_ids = req.prompt_ids
        if len(prompt_ids) > self.max_prompt_tokens:
            raise RequestError("prompt_too_long", f"prompt has {len(prompt_ids)} tokens; this server "
                               f"allows {self.max_prompt_tokens} (max_model_len {self.max_model_len})")
        self._validator.validate(prompt_ids, req.params)
        active = self.pool.active
        if not active and not self.pool.starting:
            raise RequestError("no_workers", "no worker is running and none is starting")
        seq_id = f"r{next(self._ids)}"
        seq = Sequence(seq_id, list(prompt_ids), req.params, arrival=next(self._arrivals))
        w = min(active, key=lambda h: h.scheduler.load) if active else None
        if w is None:
            self.orphans.append(seq)
        else:
            w.scheduler.enqueue(seq)
        self.pending[seq_id] = Pending(identity, req.id, req.stream, seq, w, time.perf_counter())
        self.by_client[(identity, req.id)] = seq_id
        self.per_client[identity] += 1

    def _control(self, identity: bytes, req: ControlRequest) -> None:
        if req.type == "abort":
            seq_id = self.by_client.get((identity, req.target))
            if seq_id is None:
                raise ProtocolError("not_found", f"no request {req.target!r} in flight", req.id)
            p = self.pending[seq_id]
            self._unschedule(p)
            p.seq.finish_reason = "abort"
            self._done(p)
            if req.id != req.target:
                self._send(identity, {"type": "done", "id": req.id, "aborted": req.target})
        elif req.type == "scale":
            self._send(identity, {"type": "scale", "id": req.id, **self.scale(req.target)})
        elif req.type == "stats":
            self._send(identity, {"type": "stats", "id": req.id, **self.stats()})
        elif req.type == "health":
            self._send(identity, {"type": "health", "id": req.id, "ok": bool(self.pool.active),
                                  "workers": len(self.workers), "starting": len(self.pool.starting)})
        elif req.type == "workers":
            self._send(identity, {"type": "workers", "id": req.id, "workers": [
                {"id": w.worker_id, **w.info} for w in self.workers]})

    def _unschedule(self, p: Pending) -> None:
        """Take a request out of whichever queue holds it, freeing its KV blocks."""
        if p.worker is not None:
            p.worker.scheduler.abort(p.seq.seq_id)
        elif p.seq in self.orphans:
            self.orphans.remove(p.seq)

    def _forget(self, seq_id: str) -> Pending | None:
        p = self.pending.pop(seq_id, None)
        if p is not None:
            self.by_client.pop((p.identity, p.client_id), None)
            self.per_client[p.identity] -= 1
            if self.per_client[p.identity] <= 0:
                del self.per_client[p.identity]
        return p

    def _emit(self, ev: TokenEvent) -> None:
        p = self.pending.get(ev.seq.seq_id)
        if p is None:
            return
        if p.t_first is None:
            p.t_first = time.perf_counter()
        if p.stream:
            delivered = self._send(p.identity, {"type": "token", "id": p.client_id, "token": ev.token,
                                                "index": len(ev.seq.output_ids) - 1})
            if not delivered:
                return
        if ev.finished:
            self._done(p)

    def _done(self, p: Pending) -> None:
        seq = p.seq
        self._forget(seq.seq_id)
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
        p = self._forget(seq_id)
        if p is None:
            return
        self._unschedule(p)
        self._send(p.identity, protocol.error(p.client_id, code, message))

    def _drop_client(self, identity: bytes, reason: str) -> None:
        """Abort every request of a client that left (or stopped reading) and free its blocks."""
        for p in [p for p in self.pending.values() if p.identity == identity]:
            self._forget(p.seq.seq_id)
            self._unschedule(p)
            p.seq.finish_reason = "abort"
            if reason == "slow_client":
                self.faults.slow_client += 1
                self.frontend.owe(identity, protocol.error(
                    p.client_id, "slow_client", "the client did not read its replies; request aborted"))
            else:
                self.faults.client_gone += 1
        log.warning("aborted the requests of a client (%s)", reason)

    def _send(self, identity: bytes, msg: dict) -> bool:
        """Send without blocking; a peer that is gone or not reading loses its requests."""
        result = self.frontend.send(identity, msg)
        if result is Delivery.OK:
            return True
        self._drop_client(identity, "client_gone" if result is Delivery.GONE else "slow_client")
        return False

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
        tokens = self.tokens
        return {
            "queue_length": sum(len(w.scheduler.waiting) for w in self.workers) + len(self.orphans),
            "running": sum(len(w.scheduler.running) for w in self.workers),
            "completed": self.completed, "tokens": tokens, "tokens_per_s": tokens / elapsed,
            "uptime_s": elapsed, "workers": workers, "starting": len(self.pool.starting),
            "coordinator": {"pending": len(self.pending), "clients": len(self.per_client),
                            "orphans": len(self.orphans), "owed_frames": self.frontend.owed,
                            "rss_bytes": _rss_bytes(), "pid": os.getpid()},
            "faults": {**asdict(self.faults), "client_disconnects": self.frontend.disconnects,
                       "worker_failures": [asdict(f) for f in self.pool.failures]},
        }


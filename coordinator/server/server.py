"""The coordinator's server: one thread, one loop, frames in and replies out.

Each turn of the loop: start a launch on every idle worker that has work (its
``EngineCore``), poll the front end and the workers' step sockets, turn every reply
that arrived into token events for the clients, then read client frames. Workers run
their launches in parallel; the loop never waits on one worker while another has a
reply ready, and never blocks on a client (frontend.py).

Nothing is lost to a fault: a lost worker's unfinished requests are re-run on the
others (or on its replacement) from prompt + tokens so far, and because sampling is
seeded per (request, step) they continue exactly where they were. A client that
leaves, or stops reading, has its requests aborted and their KV blocks freed. An
exception in one request fails that request alone.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import zmq

from fusedserve.coordinator.engine.config_resolution import resolve_config
from fusedserve.coordinator.engine.engine_core import EngineCore
from fusedserve.coordinator.engine.executor import WorkerGone
from fusedserve.coordinator.engine.output_processor import OutputProcessor
from fusedserve.coordinator.engine.sequence import TokenEvent
from fusedserve.coordinator.engine.socket_executor import SocketExecutor
from fusedserve.coordinator.errors import RequestError
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.server import protocol
from fusedserve.coordinator.server.admission import Admission
from fusedserve.coordinator.server.config import ServerConfig
from fusedserve.coordinator.server.frontend import Delivery, Frontend
from fusedserve.coordinator.server.protocol import ControlRequest, GenerateRequest
from fusedserve.coordinator.server.request_table import ClientRequest, RequestTable
from fusedserve.coordinator.server.router import Router
from fusedserve.coordinator.server.routing_policy import RoutingPolicy
from fusedserve.coordinator.server.stats import FaultCounters, ServerCounters, server_stats
from fusedserve.coordinator.server.worker_pool import PoolConfig, WorkerHandle, WorkerPool, probe_device
from fusedserve.coordinator.structured.compile_queue import CompileQueue
from fusedserve.kernels.model_description.lora import LoraError
from fusedserve.shared_memory.arena import HostArena, remove_stale

log = logging.getLogger(__name__)

FRAMES_PER_TURN = 256  # client frames read per loop turn: a flood cannot starve the workers


class Server:
    def __init__(self, server_config: ServerConfig):
        """``server_config``: as asked (flags); ``engine_config``: its engine part resolved (what every
        worker loads); ``model_config``: the checkpoint's ``config.json``."""
        cfg = self.server_config = server_config
        self.device = probe_device(cfg.engine.device.device)
        p = cfg.engine.parallel
        resolved = resolve_config(cfg.engine, self.device.kind, max(p.workers, 1) * p.tensor_parallel_size)
        self.engine_config, self.model_config = resolved.config, resolved.model
        self.resolved = resolved  # its KV plan and parameter count: the startup lines
        self.model_dir = self.engine_config.model.model
        self.max_model_len = self.engine_config.max_model_len
        self.tokenizer = TextTokenizer.from_dir(self.model_dir)
        self.admission = Admission(cfg.limits, self.engine_config, self.model_config, self.tokenizer,
                                   cfg.grammar, cfg.seed)
        grammars = self.admission.input.grammars
        self.compiles = CompileQueue(grammars) if grammars is not None else None
        self.output = OutputProcessor(self.model_config.eos_token_ids, self.max_model_len)
        self.requests = RequestTable()
        self.ctx = zmq.Context()
        self.pool: WorkerPool | None = None
        self.router: Router | None = None
        self.frontend: Frontend | None = None
        self.counters = ServerCounters(started_at=time.time())
        self.faults = FaultCounters()
        self.address = f"tcp://{cfg.host}:{cfg.port}"
        self._ids = itertools.count()
        self._next_expiry = 0.0  # when _expire_queued looks again
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        cfg = self.server_config
        cfg.check()
        remove_stale()
        pcfg = PoolConfig(self.engine_config, self.device, cfg.transport == "serial", cfg.step_timeout_s,
                          cfg.max_restarts, heartbeat_timeout_ms=round(cfg.heartbeat_timeout_s * 1000))
        self.pool = WorkerPool(self.ctx, pcfg, self.model_config, self._new_core)
        self.router = Router(self.pool, self.requests, RoutingPolicy(cfg.routing))
        workers = self.engine_config.parallel.workers
        n = workers if workers > 0 else self.pool.device_slots()
        self.pool.start(n)
        self.frontend = Frontend.bind(self.ctx, cfg.host, cfg.port, cfg.send_hwm, cfg.send_buffer_bytes,
                                      cfg.curve_secret_key)
        self.address = self.frontend.address
        log.info("coordinator serving on %s with %d %s workers", self.address, n, self.pool.device.kind)

    def _new_core(self, arenas: list[HostArena], executor: SocketExecutor) -> EngineCore:
        return EngineCore.for_worker(self.engine_config, self.model_config.vocab_size, self.output, arenas,
                                     executor)

    @property
    def curve_public_key(self) -> str | None:
        """What clients need to reach a CURVE-encrypted front end."""
        key = self.server_config.curve_secret_key
        return None if key is None else zmq.curve_public(key.encode()).decode()

    @property
    def workers(self) -> list[WorkerHandle]:
        return self.pool.workers if self.pool else []

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
        t0 = time.perf_counter()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for req in self.requests:
            self.requests.pop(req.seq.seq_id)
            self._send(req.identity, protocol.error(req.client_id, "shutdown", "server is shutting down"))
        if self.compiles is not None:
            self.compiles.close()
        if self.pool is not None:
            self.pool.shutdown()
        if self.frontend is not None:
            self.frontend.close(linger_ms=1000)
        self.ctx.term()
        log.info("shut down in %.2f s", time.perf_counter() - t0)

    # ----------------------------------------------------------------------- loop

    def loop_once(self) -> None:
        pool, fe = self.pool, self.frontend
        if pool.busy():
            pool.service()
        if self.router.orphans:
            self.router.service_orphans(self._fail)
        if self.compiles is not None and self.compiles.pending:
            self._admit_compiled()
        if self.server_config.limits.max_queue_time_s:
            self._expire_queued()
        for w in list(pool.workers):
            while w.core.wants_launch() and self._launch(w):
                pass  # with async scheduling, a second launch goes out behind the first
        poller = zmq.Poller()
        for sock in (fe.sock, fe.monitor, *pool.sockets()):
            poller.register(sock, zmq.POLLIN)
        ready = dict(poller.poll(5 if self.compiles is not None and self.compiles.pending else 50))
        for w in list(pool.workers):
            if w.executor.ready(ready):
                for ev in w.core.finish(w.executor.wait()):
                    self._emit(ev)
        for w, reason in pool.find_lost(ready):
            self._worker_lost(w, reason)
        if fe.monitor in ready:
            fe.peer_left()
        for identity in fe.probe(self.requests.identities()):
            self._drop_client(identity, "client_gone")
        fe.flush_owed()
        if fe.sock in ready:
            for _ in range(FRAMES_PER_TURN):
                got = fe.recv()
                if got is None:
                    break
                self._handle(*got)

    def _launch(self, w: WorkerHandle) -> bool:
        """Start the worker's next launch; False when none could start."""
        try:
            return w.core.launch()
        except WorkerGone as exc:
            self._worker_lost(w, str(exc))
        except Exception as exc:  # noqa: BLE001 - a bad step fails its requests, not the loop
            log.exception("worker %s: could not launch", w.worker_id)
            for seq in list(w.scheduler.running):
                self._fail(seq.seq_id, "internal", f"launch failed: {type(exc).__name__}: {exc}")
        return False

    def _worker_lost(self, w: WorkerHandle, reason: str) -> None:
        seqs = [s for s in self.pool.remove_lost(w, reason) if self.requests.get(s.seq_id)]
        self.faults.reruns += len(seqs)
        self.router.place(seqs)

    # ------------------------------------------------------------------- requests

    def _handle(self, identity: bytes, frame: bytes) -> None:
        try:
            req = protocol.parse(frame, self.server_config.auth_token, self.server_config.admin_token)
        except RequestError as exc:
            if exc.code == "unauthorized":
                self.faults.unauthorized += 1
            self._send(identity, protocol.error(exc.request_id, exc.code, str(exc)))
            return
        try:
            if isinstance(req, GenerateRequest):
                self._generate(identity, req)
            else:
                self._control(identity, req)
        except RequestError as exc:
            self._send(identity, protocol.error(req.id, exc.code, str(exc)))
        except Exception as exc:  # noqa: BLE001 - never let one request take the server down
            log.exception("request %r failed", req.id)
            self.faults.request_errors += 1
            self._send(identity, protocol.error(req.id, "internal", f"{type(exc).__name__}: {exc}"))

    def _generate(self, identity: bytes, req: GenerateRequest) -> None:
        self.admission.check_limits(identity, req, self.requests)
        n = next(self._ids)
        seq = self.admission.sequence(f"r{n}", n, req)
        if not self.pool.active and not self.pool.starting:
            raise RequestError("no_workers", "no worker is running and none is starting")
        entry = ClientRequest(identity, req.id, req.stream, seq, None, time.perf_counter(),
                              end_client=req.client)
        if req.params.structured is not None:  # routed once its grammar compiled, off this thread
            self.compiles.submit(seq.seq_id, req.params.structured)
        else:
            entry.worker = self.router.admit(seq)
        self.requests.add(entry)

    def _admit_compiled(self) -> None:
        """Route the requests whose grammars compiled; refuse those that could not (or in time)."""
        for seq_id, result in self.compiles.finished():
            entry = self.requests.get(seq_id)
            if entry is None:  # aborted or its client left while compiling
                continue
            if isinstance(result, RequestError):
                self._fail(seq_id, result.code, str(result))
                continue
            entry.seq.grammar = result
            entry.worker = self.router.admit(entry.seq)

    def _expire_queued(self) -> None:
        """Refuse what waited past ``--max-queue-time`` without a launch taking it (at most every
        0.1 s): under a burst the queue holds what can start in time, and the rest hear so."""
        now = time.perf_counter()
        if now < self._next_expiry:
            return
        self._next_expiry = now + 0.1
        limit = self.server_config.limits.max_queue_time_s
        for req in self.requests.queued_since(now - limit):
            self.faults.queue_timeouts += 1
            self._fail(req.seq.seq_id, "server_busy", f"waited {now - req.t_arrival:.1f} s in the queue "
                       f"(--max-queue-time {limit:g}); retry later")

    def _control(self, identity: bytes, req: ControlRequest) -> None:
        reply: dict
        if req.type == "abort":
            target = self.requests.find(identity, req.target)
            if target is None:
                raise RequestError("not_found", f"no request {req.target!r} in flight", req.id)
            self.router.unschedule(target)
            target.seq.finish_reason = "abort"
            self._done(target)
            if req.id == req.target:
                return
            reply = {"type": "done", "aborted": req.target}
        elif req.type == "scale":
            reply = {"type": "scale", **self.router.scale(req.target, self.server_config.max_workers)}
        elif req.type == "stats":
            reply = {"type": "stats", **self.stats()}
        elif req.type == "health":
            reply = {"type": "health", "ok": bool(self.pool.active), "workers": len(self.workers),
                     "starting": len(self.pool.starting)}
        elif req.type in ("loras", "load_lora", "unload_lora"):
            reply = self._loras(req)
        else:  # workers
            reply = {"type": "workers", "workers": [{"id": w.worker_id, **w.info} for w in self.workers]}
        self._send(identity, {**reply, "id": req.id})

    def _loras(self, req: ControlRequest) -> dict:
        """List, load or unload LoRA adapters. Unloading refuses new requests for the name at once;
        requests already running under it finish under it."""
        registry = self.admission.loras
        if req.type == "load_lora":
            name, path = req.target
            try:
                served = registry.add(name, path)
            except LoraError as exc:
                raise RequestError("bad_lora", str(exc), req.id) from None
            log.info("LoRA adapter %r loaded from %s (rank %d)", name, path, served.adapter.rank)
        elif req.type == "unload_lora":
            registry.remove(req.target[0])
            log.info("LoRA adapter %r unloaded", req.target[0])
        return {"type": "loras", "enabled": registry.lora.enable_lora, "adapters": registry.listing()}

    # -------------------------------------------------------------------- replies

    def _emit(self, ev: TokenEvent) -> None:
        """Deliver one event; an exception here fails this request alone."""
        req = self.requests.get(ev.seq.seq_id)
        if req is None:
            return
        try:
            if ev.error is not None:
                self.faults.request_errors += ev.error.code not in ("worker_error", "grammar_error")
                self._fail(ev.seq.seq_id, ev.error.code, str(ev.error))
                return
            if req.t_first is None:
                req.t_first = time.perf_counter()
            if req.stream and not self._send(req.identity, protocol.token(req.client_id, ev)):
                return
            if ev.finished:
                self._done(req)
        except Exception as exc:  # noqa: BLE001 - isolated to this request
            log.exception("request %s failed while replying", ev.seq.seq_id)
            self.faults.request_errors += 1
            self._fail(ev.seq.seq_id, "internal", f"{type(exc).__name__}: {exc}")

    def _done(self, req: ClientRequest) -> None:
        seq = req.seq
        self.requests.pop(seq.seq_id)
        self.counters.completed += 1
        now = time.perf_counter()
        first, scheduled = req.t_first or now, seq.t_scheduled or req.t_arrival
        timings = {"ttft_s": first - req.t_arrival, "total_s": now - req.t_arrival,
                   "queue_s": scheduled - req.t_arrival, "prefill_s": first - scheduled,
                   "decode_s": now - first, "inference_s": now - scheduled}
        self._send(req.identity, protocol.done(req.client_id, seq, timings))

    def _fail(self, seq_id: str, code: str, message: str) -> None:
        req = self.requests.pop(seq_id)
        if req is None:
            return
        self.router.unschedule(req)
        self._send(req.identity, protocol.error(req.client_id, code, message))

    def _drop_client(self, identity: bytes, reason: str) -> None:
        """Abort every request of a client that left (or stopped reading) and free its blocks."""
        for req in self.requests.of_client(identity):
            self.requests.pop(req.seq.seq_id)
            self.router.unschedule(req)
            req.seq.finish_reason = "abort"
            if reason == "slow_client":
                self.faults.slow_client += 1
                self.frontend.owe(identity, protocol.error(
                    req.client_id, "slow_client", "the client did not read its replies; request aborted"))
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

    def stats(self) -> dict:
        grammars = self.admission.input.grammars
        return server_stats(self.counters, self.faults, self.requests, self.router, self.pool, self.frontend,
                            grammars.cached if grammars is not None else 0)

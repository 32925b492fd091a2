"""One worker's step, written once: schedule -> write arena -> launch -> read -> sample.

``launch()`` starts the next step on the executor and returns at once; ``finish(reply)``
turns the worker's reply into token events. The offline engine calls the two back to
back (``step()``); the server calls ``launch()`` on every idle worker, then ``finish()``
on whichever replies first, so workers run in parallel. The core also keeps the
worker's step counters: nothing else writes them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from coordinator.batch_io import read_result, write_batch
from coordinator.errors import RequestError
from coordinator.executor import Executor
from coordinator.scheduler import Scheduler, StepBatch
from coordinator.sequence import Sequence, TokenEvent
from shared_memory.arena import HostArena
from shared_memory.contract import LaunchDescriptor, LaunchReply


@dataclass
class StepStats:
    steps: int = 0
    tokens: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    launch_s: float = 0.0  # time inside the worker's launches
    last_decode: dict | None = None
    # Recent decode steps as (batch, coordinator wall s, worker launch s): the overhead figure.
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))


@dataclass
class Inflight:
    batch: StepBatch
    desc: LaunchDescriptor
    started: float  # perf_counter at schedule time


class EngineCore:
    def __init__(self, scheduler: Scheduler, arena: HostArena, executor: Executor, top_k: int,
                 vocab_size: int, hidden_size: int):
        self.scheduler = scheduler
        self.arena = arena
        self.executor = executor
        self._dims = (top_k, vocab_size, hidden_size)
        self.inflight: Inflight | None = None
        self.stats = StepStats()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def idle(self) -> bool:
        return self.inflight is None

    def launch(self) -> bool:
        """Schedule the next step and start it; False when nothing could be scheduled.

        Raises ``executor.WorkerGone`` when the worker cannot take it (the step stays
        scheduled: its sequences are still the scheduler's, for the caller to move).
        """
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            return False
        desc = write_batch(self.arena, batch, self.scheduler.steps, *self._dims)
        self.executor.submit(desc)
        self.inflight = Inflight(batch, desc, t0)
        return True

    def finish(self, reply: LaunchReply) -> list[TokenEvent]:
        """Sample from the launch's outputs; a failed launch fails each of its requests."""
        inflight, self.inflight = self.inflight, None
        if inflight is None:
            raise RuntimeError("finish() without a launch in flight")
        batch, desc = inflight.batch, inflight.desc
        if not reply.ok:
            events = []
            for seq in batch.seqs:
                if seq.finish_reason is None:
                    self.scheduler.abort(seq.seq_id)
                    seq.finish_reason = "error"
                    events.append(TokenEvent(seq, None, True,
                                             error=RequestError("worker_error", reply.error)))
            return events
        s = self.stats
        s.steps += 1
        s.h2d_bytes += reply.h2d
        s.d2h_bytes += reply.d2h
        s.launch_s += reply.seconds
        events = self.scheduler.process(batch, read_result(self.arena, desc))
        s.tokens += sum(ev.token is not None for ev in events)
        if desc.table == "decode":
            b = desc.dims["B"]
            s.last_decode = {"batch": b, "h2d": reply.h2d, "d2h": reply.d2h, "seconds": reply.seconds}
            s.recent.append((b, time.perf_counter() - inflight.started, reply.seconds))
        return events

    def step(self) -> list[TokenEvent]:
        """launch + wait + finish: the offline engine's whole step."""
        if not self.launch():
            raise RuntimeError("scheduler has work but could not schedule a launch")
        return self.finish(self.executor.wait())

    def unfinished(self) -> list[Sequence]:
        """Every request this worker holds, oldest first (to re-run elsewhere)."""
        s = self.scheduler
        return sorted([*s.running, *s.waiting], key=lambda q: q.arrival)

"""One worker's step, written once: schedule -> write arena -> launch -> read -> output.

``launch()`` starts the next step on the executor and returns at once; ``finish(reply)``
turns the oldest launch's reply into token events. The offline engine calls them from
``step()``; the server calls ``launch()`` on every worker that wants one, then
``finish()`` on whichever replies first, so workers run in parallel.

Async scheduling keeps two launches in flight: launch n+1 is scheduled and sent while
launch n runs, its rows fed the ids n leaves on the device, so the device never waits
for the coordinator to read, stream and check stops. Each launch of the pair has its
own arena bank, so writing n+1's inputs never touches n's outputs. The core also keeps
the worker's step counters: nothing else writes them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from fusedserve.coordinator.engine.batch_io import OutputPlan, read_outputs, write_batch
from fusedserve.coordinator.engine.executor import Executor
from fusedserve.coordinator.engine.lora_slots import LoraSlots
from fusedserve.coordinator.engine.output_processor import OutputProcessor
from fusedserve.coordinator.engine.scheduled_batch import ScheduledBatch
from fusedserve.coordinator.engine.scheduler import Scheduler
from fusedserve.coordinator.engine.sequence import Sequence, TokenEvent
from fusedserve.coordinator.engine.sequence_slots import SequenceSlots
from fusedserve.coordinator.errors import RequestError
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.contract import LaunchDescriptor, LaunchReply
from fusedserve.shared_memory.engine_config import EngineConfig


@dataclass
class StepStats:
    steps: int = 0
    tokens: int = 0
    h2d_bytes: int = 0
    d2h_bytes: int = 0
    launch_s: float = 0.0  # time inside the worker's launches
    idle_s: float = 0.0  # the worker's gaps between launches
    wait_s: float = 0.0  # of those, its waits for the coordinator's next descriptor
    ahead: int = 0  # launches sent while the previous one was in flight
    fed_rows: int = 0  # rows whose input id the device took from the previous launch
    max_launch_tokens: int = 0  # the most tokens one launch carried (<= max_num_batched_tokens)
    last_decode: dict | None = None
    # Recent decode steps as (batch, worker gap s before it, of which waiting for the coordinator,
    # worker launch s): the overhead figure.
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))


@dataclass
class Inflight:
    batch: ScheduledBatch
    desc: LaunchDescriptor
    plan: OutputPlan
    started: float  # perf_counter when it was sent, or when the launch before it finished


class EngineCore:
    def __init__(self, scheduler: Scheduler, output: OutputProcessor, arenas: list[HostArena],
                 executor: Executor, candidates: int, vocab_size: int, async_scheduling: bool = False,
                 recurrent_state: bool = False, pooled_width: int = 0, max_loras: int = 0):
        self.scheduler = scheduler
        self.output = output
        self.arenas = arenas
        self.executor = executor
        self._sampling = (candidates, vocab_size)
        self.pooled_width = pooled_width  # a pooling runner's floats per pooled row
        self.inflight: deque[Inflight] = deque()
        self.async_scheduling = async_scheduling and len(arenas) > 1
        self.stats = StepStats()
        self.penalties = SequenceSlots(scheduler.max_batch, lambda seq: seq.params.penalized)
        # A hybrid model's recurrent state: a slot per running request (kernels/hybrid_cache.py).
        self.states = SequenceSlots(scheduler.max_batch, lambda seq: True) if recurrent_state else None
        self.loras = LoraSlots(max_loras) if max_loras else None  # the worker's LoRA adapter slots

    @classmethod
    def for_worker(cls, cfg: EngineConfig, vocab_size: int, output: OutputProcessor, arenas: list[HostArena],
                   executor: Executor) -> EngineCore:
        """One worker's core, offline and served alike: its scheduler over its own KV blocks."""
        return cls(Scheduler.for_worker(cfg), output, arenas, executor, cfg.device.sampler_candidates,
                   vocab_size, cfg.scheduler.async_scheduling, cfg.cache.recurrent_state,
                   cfg.model.pooled_width if cfg.pooling else 0,
                   cfg.lora.max_loras if cfg.lora.enable_lora else 0)

    def has_work(self) -> bool:
        """Requests to run, or launches whose replies are still owed."""
        return self.scheduler.has_work() or bool(self.inflight)

    @property
    def idle(self) -> bool:
        return not self.inflight

    @property
    def running_since(self) -> float | None:
        """When the worker started the oldest launch in flight (for the hang check)."""
        return self.inflight[0].started if self.inflight else None

    def wants_launch(self) -> bool:
        """Whether ``launch()`` may run now: nothing in flight, or (async scheduling) one launch
        without speculating requests, whose ids can feed the next launch on the device."""
        if not self.scheduler.has_work():
            return False
        # A launch with speculating requests is read before the next is sent: their rows could not
        # ride in it (their proposals need their newest tokens), and would skip every other launch.
        return not self.inflight or (self.async_scheduling and len(self.inflight) == 1
                                     and not self.inflight[0].batch.spec_groups)

    def launch(self) -> bool:
        """Schedule the next step and start it; False when nothing could be scheduled.

        Raises ``executor.WorkerGone`` when the worker cannot take it (the step stays
        scheduled: its sequences are still the scheduler's, for the caller to move).
        """
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            return False
        bank = self.scheduler.steps % len(self.arenas)
        slots = self.penalties.assign(batch, self.scheduler.running)
        states = None if self.states is None else self.states.assign(batch, self.scheduler.running)
        snapshots = self.scheduler.snapshots
        copies = snapshots.plan(batch, states) if snapshots is not None and states is not None else None
        loras = self.loras.assign(batch, self.scheduler.running) if self.loras is not None else (None, [])
        desc, plan = write_batch(self.arenas[bank], batch, self.scheduler.steps, bank, *self._sampling, slots,
                                 states, copies, self.pooled_width, loras)
        self.executor.submit(desc)
        self.stats.ahead += bool(self.inflight)
        self.stats.fed_rows += int((batch.feed_rows >= 0).sum())
        self.stats.max_launch_tokens = max(self.stats.max_launch_tokens, batch.num_tokens)
        self.inflight.append(Inflight(batch, desc, plan, t0))
        return True

    def finish(self, reply: LaunchReply) -> list[TokenEvent]:
        """Read the oldest launch's outputs; a failed launch fails each of its requests."""
        if not self.inflight:
            raise RuntimeError("finish() without a launch in flight")
        inflight = self.inflight.popleft()
        if self.inflight:
            self.inflight[0].started = time.perf_counter()
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
        s.idle_s += reply.idle
        s.wait_s += reply.wait
        out = read_outputs(self.arenas[desc.bank], desc, inflight.plan)
        events = self.output.process(batch, self.scheduler.settle(batch), out)
        if batch.spec_groups:
            self.scheduler.speculated(batch, out.accepted())
        self.scheduler.update(events)
        s.tokens += sum(ev.token is not None for ev in events)
        if desc.kind == "decode":
            b = desc.dims["B"]
            s.last_decode = {"batch": b, "h2d": reply.h2d, "d2h": reply.d2h, "seconds": reply.seconds}
            s.recent.append((b, reply.idle, reply.wait, reply.seconds))
        return events

    def step(self) -> list[TokenEvent]:
        """The offline engine's step: launch (and, with async scheduling, the one after it
        too), then wait for and finish the oldest launch."""
        if not self.inflight and not self.launch():
            raise RuntimeError("scheduler has work but could not schedule a launch")
        if self.wants_launch():
            self.launch()
        return self.finish(self.executor.wait())

    def drain(self) -> None:
        """Wait out the launches in flight and drop their replies (after an error)."""
        while self.inflight:
            self.inflight.popleft()
            self.executor.wait()

    def unfinished(self) -> list[Sequence]:
        """Every request this worker holds, oldest first (to re-run elsewhere)."""
        s = self.scheduler
        return sorted([*s.running, *s.waiting], key=lambda q: q.arrival)

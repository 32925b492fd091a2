"""Helpers shared by the tests that talk to a server or wait on other processes."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import zmq

from coordinator.client import Client
from coordinator.engine.output_processor import OutputProcessor
from coordinator.engine.scheduled_batch import ScheduledBatch
from coordinator.engine.scheduler import Scheduler
from coordinator.engine.sequence import Sequence, TokenEvent
from coordinator.engine.step_outputs import StepOutputs
from coordinator.sampling_params import SamplingParams


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

"""Grammars inside explicit parser limits: refused at admission where llguidance can tell (compiled
off the coordinator's loop, which keeps streaming meanwhile), and a limit met only mid-generation
ends that one request with a coded ``grammar_error``, never a 500 and never another request."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from fusedserve.coordinator.client import Client, ServerError
from fusedserve.coordinator.engine.engine_core import EngineCore
from fusedserve.coordinator.engine.executor import InProcessExecutor
from fusedserve.coordinator.engine.output_processor import OutputProcessor
from fusedserve.coordinator.engine.sequence import Sequence
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.engine_config import EngineConfig
from fusedserve.shared_memory.slots import step_table
from tests.support import EchoRunner, settled

ALTERNATIVES = " | ".join(json.dumps(f"w{i}x") for i in range(12_000))
# The four that reached "sampling failed" (HTTP 500) mid-generation before the limits were explicit.
PAST_THE_LIMITS = {
    "lark_12000_alternatives": {"kind": "grammar", "value": "start: x\nx: " + ALTERNATIVES},
    "never_ends": {"kind": "grammar", "value": 'start: x\nx: "a" x'},
    "recursive_ref": {"kind": "json", "value": {
        "$ref": "#/definitions/a", "definitions": {"a": {
            "type": "object", "properties": {"b": {"$ref": "#/definitions/a"}}, "required": ["b"]}}}},
    "choice_50000": {"kind": "choice", "value": [f"option number {i}" for i in range(50_000)]},
}


SERVER = dict(dtype="float32", max_batch=8, block_size=16, num_blocks=128, max_model_len=512)


def test_grammars_past_the_limits_are_refused_while_other_streams_go_on(server):
    tokens: list[int] = []
    done = threading.Event()

    def stream() -> None:
        with Client(server.address, timeout_s=120) as c:
            for f in c.stream("The history of", max_tokens=400, ignore_eos=True):
                if f["type"] == "token":
                    tokens.append(f["token"])
        done.set()

    runner = threading.Thread(target=stream, daemon=True)
    runner.start()
    with Client(server.address, timeout_s=120) as c:
        while len(tokens) < 5:
            done.wait(0.01)
        for name, spec in PAST_THE_LIMITS.items():
            before = len(tokens)
            with pytest.raises(ServerError) as err:
                c.generate("x", max_tokens=16, structured=spec)
            assert err.value.reply["code"] == "bad_structured_output", (name, err.value.reply)
            assert "limits" in err.value.reply["message"], name
            if name == "choice_50000":  # seconds of compiling: the stream went on meanwhile
                assert len(tokens) > before, "the loop kept streaming while the grammar compiled"
        runner.join(120)
        assert len(tokens) == 400
        stats = settled(c)
    assert stats["faults"]["request_errors"] == 0
    assert all(w["kv_blocks_used"] == 0 for w in stats["workers"])


class _BreaksAfter:
    """A grammar state that accepts ``n`` tokens, then raises as llguidance does past a limit."""

    def __init__(self, n: int, in_fill: bool = False):
        self.n, self.in_fill, self.done = n, in_fill, False

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        if self.in_fill and self.n <= 0:
            raise RuntimeError("parser error: Too many items (limit 50000; ff_tokens)")
        bitmask[row] = -1

    adjust = fill
    matcher = None
    phase = "free"
    executor = None

    def accept(self, token: int) -> None:
        self.n -= 1
        if self.n < 0 and not self.in_fill:
            raise ValueError("token breaks the grammar: parser error: Too many items (limit 50000)")


@pytest.mark.parametrize("in_fill", [False, True], ids=["accept", "mask"])
def test_a_limit_met_mid_generation_ends_that_request_alone(in_fill, monkeypatch):
    import fusedserve.coordinator.engine.batch_io as batch_io
    monkeypatch.setattr(batch_io, "fill_rows", lambda rows, mask: [s.fill(mask, r) for s, r in rows])
    cfg = EngineConfig.build(max_batch=4, block_size=4, num_blocks=32, max_model_len=64,
                             max_num_batched_tokens=16, async_scheduling=False)
    arenas = [HostArena.create(step_table(), cfg.max_dims(4096), tag="gram") for _ in range(cfg.banks)]
    try:
        core = EngineCore.for_worker(cfg, 4096, OutputProcessor((), 64), arenas,
                                     InProcessExecutor(EchoRunner(arenas, 4096)))
        broken = Sequence("broken", [10], SamplingParams(max_tokens=10), arrival=0)
        broken.grammar = _BreaksAfter(3, in_fill)
        plain = Sequence("plain", [20], SamplingParams(max_tokens=10), arrival=1)
        for s in (broken, plain):
            core.scheduler.enqueue(s)
        errors = []
        while core.has_work():
            errors += [ev.error for ev in core.step() if ev.error is not None]
        assert [e.code for e in errors] == ["grammar_error"] and "limit" in str(errors[0])
        assert broken.finish_reason == "error" and broken.output_ids == [11, 12, 13]
        assert plain.output_ids == list(range(21, 31)) and plain.finish_reason == "length"
        assert core.scheduler.blocks.num_used == 0
    finally:
        for a in arenas:
            a.close()

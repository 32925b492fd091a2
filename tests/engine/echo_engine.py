"""A model-free engine for the engine room's tests: the real ``EngineCore`` (scheduler, block
manager, batch I/O, arena banks, output processor) around ``EchoRunner`` (tests/support.py),
whose tokens are known in advance: ``prompt[-1] + 1, + 2, ...`` whatever the batching."""

from __future__ import annotations

from dataclasses import dataclass

from fusedserve.coordinator.engine.detokenizer import Detokenizer
from fusedserve.coordinator.engine.engine_core import EngineCore
from fusedserve.coordinator.engine.executor import InProcessExecutor
from fusedserve.coordinator.engine.output_processor import OutputProcessor
from fusedserve.coordinator.engine.sequence import Sequence, TokenEvent
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.shared_memory.arena import HostArena
from fusedserve.shared_memory.engine_config import EngineConfig
from fusedserve.shared_memory.slots import step_table
from tests.support import EchoRunner

VOCAB = 4096
EOS = 4095
SMALL = {"max_batch": 4, "block_size": 4, "num_blocks": 64, "max_model_len": 128,
         "max_num_batched_tokens": 16}


@dataclass
class EchoEngine:
    """An ``EngineCore`` whose runner answers ``prompt[-1] + 1, + 2, ...``, and its arena banks."""

    core: EngineCore
    runner: EchoRunner
    arenas: list[HostArena]

    def run(self, seqs: list[Sequence]) -> dict[str, list[TokenEvent]]:
        """Every sequence to its end; the events of each, checked to stop at its last."""
        for s in seqs:
            self.core.scheduler.enqueue(s)
        events: dict[str, list[TokenEvent]] = {s.seq_id: [] for s in seqs}
        while self.core.has_work():
            for ev in self.core.step():
                assert not events[ev.seq.seq_id] or not events[ev.seq.seq_id][-1].finished
                events[ev.seq.seq_id].append(ev)
        return events


def echo_seq(i: int, prompt: list[int], tok: TextTokenizer | None = None, **params: object) -> Sequence:
    """Request ``s{i}`` (6 tokens unless ``params`` say otherwise)."""
    p = SamplingParams(**{"max_tokens": 6, **params})
    return Sequence(f"s{i}", prompt, p, arrival=i, detok=Detokenizer(tok, p.stop) if tok else None)


def new_echo_engine(**settings: object) -> EchoEngine:
    """``settings``: ``EngineConfig`` names over ``SMALL``; close its ``arenas`` after use."""
    cfg = EngineConfig.build(**{**SMALL, **settings})
    arenas = [HostArena.create(step_table(), cfg.max_dims(VOCAB), tag="echo") for _ in range(cfg.banks)]
    runner = EchoRunner(arenas, VOCAB)
    core = EngineCore.for_worker(cfg, VOCAB, OutputProcessor((EOS,), cfg.max_model_len), arenas,
                                 InProcessExecutor(runner))
    return EchoEngine(core, runner, arenas)

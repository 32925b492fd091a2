"""The engine step without a model: the real scheduler, block manager, batch I/O, arena banks and
output processor around ``EchoRunner`` (tests/support.py), whose tokens are known in advance."""

from __future__ import annotations

import pytest

from coordinator.engine.batch_io import read_outputs, write_batch
from coordinator.engine.detokenizer import Detokenizer
from coordinator.engine.engine_core import EngineCore
from coordinator.engine.executor import InProcessExecutor
from coordinator.engine.output_processor import OutputProcessor
from coordinator.engine.sequence import Sequence
from coordinator.model_files.default_model import resolve_model
from coordinator.model_files.tokenizer import TextTokenizer
from coordinator.sampling_params import SamplingParams
from shared_memory.arena import HostArena
from shared_memory.engine_config import EngineConfig
from shared_memory.slots import step_table
from tests.support import EchoRunner

VOCAB = 4096
EOS = 4095


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_dir(resolve_model("default"))


def _core(**settings: object) -> tuple[EngineCore, EchoRunner, list[HostArena]]:
    cfg = EngineConfig.build(**{"max_batch": 4, "block_size": 4, "num_blocks": 64, "max_model_len": 128,
                                "max_num_batched_tokens": 16, **settings})
    arenas = [HostArena.create(step_table(), cfg.max_dims(VOCAB), tag="fake") for _ in range(cfg.banks)]
    runner = EchoRunner(arenas, VOCAB)
    core = EngineCore.for_worker(cfg, VOCAB, OutputProcessor((EOS,), cfg.max_model_len), arenas,
                                 InProcessExecutor(runner))
    return core, runner, arenas


def _run(core: EngineCore, seqs: list[Sequence]) -> dict[str, list]:
    for s in seqs:
        core.scheduler.enqueue(s)
    events: dict[str, list] = {s.seq_id: [] for s in seqs}
    while core.has_work():
        for ev in core.step():
            assert not events[ev.seq.seq_id] or not events[ev.seq.seq_id][-1].finished
            events[ev.seq.seq_id].append(ev)
    return events


def _seq(i: int, prompt: list[int], tok: TextTokenizer | None = None, **params: object) -> Sequence:
    p = SamplingParams(**{"max_tokens": 6, **params})
    return Sequence(f"s{i}", prompt, p, arrival=i, detok=Detokenizer(tok, p.stop) if tok else None)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_outputs_follow_the_runner_whatever_the_batching(async_scheduling):
    core, runner, arenas = _core(async_scheduling=async_scheduling)
    try:
        # 7 requests for 4 rows, prompts over the 16-token budget: queued, chunked, batched.
        prompts = [list(range(10 * i + 1, 10 * i + 1 + n)) for i, n in enumerate([3, 20, 5, 1, 9, 17, 2])]
        seqs = [_seq(i, p, max_tokens=3 + i) for i, p in enumerate(prompts)]
        events = _run(core, seqs)
        for s, p in zip(seqs, prompts):
            want = [p[-1] + k for k in range(1, s.params.max_tokens + 1)]
            assert s.output_ids == want and s.finish_reason == "length"
            assert [e.token for e in events[s.seq_id]] == want
        assert core.scheduler.blocks.num_used == 0
        assert all(d.dims["T"] <= 16 for d in runner.launches), "no launch over the token budget"
        assert any(d.num_decode and d.prompt_query_lens for d in runner.launches), "chunks rode with decodes"
        assert (core.stats.fed_rows > 0) == async_scheduling
        assert {d.bank for d in runner.launches} == ({0, 1} if async_scheduling else {0})
        assert core.stats.tokens == sum(len(s.output_ids) for s in seqs)
    finally:
        for a in arenas:
            a.close()


def test_a_stop_id_ends_the_request_and_its_extra_row_is_dropped():
    core, runner, arenas = _core()
    try:
        stop = _seq(0, [100, 101], max_tokens=20, stop_token_ids=[105])
        eos = _seq(1, [EOS - 3], max_tokens=20)
        free = _seq(2, [EOS - 3], max_tokens=5, ignore_eos=True)
        _run(core, [stop, eos, free])
        assert stop.output_ids == [102, 103, 104, 105] and stop.finish_reason == "stop"
        assert eos.output_ids == [EOS - 2, EOS - 1, EOS] and eos.finish_reason == "stop"
        assert free.output_ids == [EOS - 2, EOS - 1, EOS, 0, 1] and free.finish_reason == "length"
        # With async scheduling a stop seen one launch late costs one row, which is never streamed.
        rows = sum(1 for d in runner.launches for _ in range(d.dims["B"]))
        assert rows >= sum(len(s.output_ids) for s in (stop, eos, free))
        assert core.scheduler.blocks.num_used == 0
    finally:
        for a in arenas:
            a.close()


def test_stop_strings_cut_the_text_and_the_deltas_add_up(tok):
    core, _, arenas = _core()
    try:
        prompt = tok.encode("The")
        full = tok.decode([prompt[-1] + k for k in range(1, 13)])
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        many = [f"never {i}" for i in range(63)] + [stop]  # the most stop strings a request may carry
        a = _seq(0, prompt, tok, max_tokens=12, stop=many)
        b = _seq(1, prompt, tok, max_tokens=12)
        events = _run(core, [a, b])
        assert a.finish_reason == "stop" and a.text == full[: full.find(stop)]
        assert "".join(e.text for e in events["s0"]) == a.text
        assert b.text == full and "".join(e.text for e in events["s1"]) == full
    finally:
        for x in arenas:
            x.close()


def test_logprobs_are_read_from_the_output_slots_for_the_rows_that_asked():
    core, _, arenas = _core(async_scheduling=False)
    try:
        plain = _seq(0, [7, 8], max_tokens=3)
        asked = _seq(1, [20], max_tokens=3, logprobs=True, top_logprobs=2)
        _run(core, [plain, asked])
        assert asked.output_ids == [21, 22, 23]
        assert asked.logprobs == pytest.approx([-(t / VOCAB) for t in (21, 22, 23)])
        assert asked.top_logprobs == [[(t, -1.0), (t + 1, -1.0)] for t in (21, 22, 23)]
        assert plain.logprobs == [] and plain.output_ids == [9, 10, 11]
    finally:
        for a in arenas:
            a.close()


def test_batch_io_goes_one_way():
    """Inputs land in the input slots; what comes back is read from output slots alone, with the
    rows that asked for logprobs known from the launch's plan, not from an input slot."""
    core, runner, arenas = _core(async_scheduling=False)
    try:
        seqs = [_seq(0, [5, 6, 7], max_tokens=2), _seq(1, [9], max_tokens=2, logprobs=True, top_logprobs=1)]
        for s in seqs:
            core.scheduler.enqueue(s)
        batch = core.scheduler.schedule()
        with pytest.raises(AttributeError):  # frozen once scheduled
            batch.num_decode = 1
        desc, plan = write_batch(arenas[0], batch, 7, 0, 64, VOCAB)
        a = arenas[0]
        assert a.view("token_ids", (desc.dims["T"],)).tolist() == [5, 6, 7, 9]
        tables = batch.block_tables
        assert a.view("block_tables", tables.shape).numpy().tolist() == tables.tolist()
        assert plan.logprob_rows == (1,) and desc.dims["NL"] == 1 and desc.bank == 0 and desc.step == 7
        runner.execute(desc)
        a.view("logprob_rows", (1,)).fill_(0)  # an input slot: never read back
        out = read_outputs(a, desc, plan)
        assert out.token(0, "s0") == 8 and out.token(1, "s1") == 10
        assert out.logprobs(1, "s1", 1) == (pytest.approx(-10 / VOCAB), [(10, -1.0)])
        assert out.logprob_rows == [1]
    finally:
        for x in arenas:
            x.close()

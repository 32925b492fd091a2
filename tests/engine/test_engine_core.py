"""The engine step without a model: the real scheduler, block manager, batch I/O, arena banks and
output processor around ``EchoRunner`` (tests/support.py), whose tokens are known in advance."""

from __future__ import annotations

import pytest

from fusedserve.coordinator.engine.batch_io import read_outputs, write_batch
from fusedserve.coordinator.model_files.default_model import resolve_model
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from tests.engine.echo_engine import EOS, VOCAB, echo_seq


@pytest.fixture(scope="module")
def tok() -> TextTokenizer:
    return TextTokenizer.from_dir(resolve_model("default"))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_outputs_follow_the_runner_whatever_the_batching(async_scheduling, echo_engine):
    eng = echo_engine(async_scheduling=async_scheduling)
    core, runner = eng.core, eng.runner
    # 7 requests for 4 rows, prompts over the 16-token budget: queued, chunked, batched.
    prompts = [list(range(10 * i + 1, 10 * i + 1 + n)) for i, n in enumerate([3, 20, 5, 1, 9, 17, 2])]
    seqs = [echo_seq(i, p, max_tokens=3 + i) for i, p in enumerate(prompts)]
    events = eng.run(seqs)
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


def test_a_stop_id_ends_the_request_and_its_extra_row_is_dropped(echo_engine):
    eng = echo_engine()
    core, runner = eng.core, eng.runner
    stop = echo_seq(0, [100, 101], max_tokens=20, stop_token_ids=[105])
    eos = echo_seq(1, [EOS - 3], max_tokens=20)
    free = echo_seq(2, [EOS - 3], max_tokens=5, ignore_eos=True)
    eng.run([stop, eos, free])
    assert stop.output_ids == [102, 103, 104, 105] and stop.finish_reason == "stop"
    assert eos.output_ids == [EOS - 2, EOS - 1, EOS] and eos.finish_reason == "stop"
    assert free.output_ids == [EOS - 2, EOS - 1, EOS, 0, 1] and free.finish_reason == "length"
    # With async scheduling a stop seen one launch late costs one row, which is never streamed.
    rows = sum(1 for d in runner.launches for _ in range(d.dims["B"]))
    assert rows >= sum(len(s.output_ids) for s in (stop, eos, free))
    assert core.scheduler.blocks.num_used == 0


def test_stop_strings_cut_the_text_and_the_deltas_add_up(tok, echo_engine):
    eng = echo_engine()
    prompt = tok.encode("The")
    full = tok.decode([prompt[-1] + k for k in range(1, 13)])
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    many = [f"never {i}" for i in range(63)] + [stop]  # the most stop strings a request may carry
    a = echo_seq(0, prompt, tok, max_tokens=12, stop=many)
    b = echo_seq(1, prompt, tok, max_tokens=12)
    events = eng.run([a, b])
    assert a.finish_reason == "stop" and a.text == full[: full.find(stop)]
    assert "".join(e.text for e in events["s0"]) == a.text
    assert b.text == full and "".join(e.text for e in events["s1"]) == full


def test_logprobs_are_read_from_the_output_slots_for_the_rows_that_asked(echo_engine):
    eng = echo_engine(async_scheduling=False)
    plain = echo_seq(0, [7, 8], max_tokens=3)
    asked = echo_seq(1, [20], max_tokens=3, logprobs=True, top_logprobs=2)
    eng.run([plain, asked])
    assert asked.output_ids == [21, 22, 23]
    assert asked.logprobs == pytest.approx([-(t / VOCAB) for t in (21, 22, 23)])
    assert asked.top_logprobs == [[(t, -1.0), (t + 1, -1.0)] for t in (21, 22, 23)]
    assert plain.logprobs == [] and plain.output_ids == [9, 10, 11]


def test_batch_io_goes_one_way(echo_engine):
    """Inputs land in the input slots; what comes back is read from output slots alone, with the
    rows that asked for logprobs known from the launch's plan, not from an input slot."""
    eng = echo_engine(async_scheduling=False)
    core, runner, arenas = eng.core, eng.runner, eng.arenas
    seqs = [echo_seq(0, [5, 6, 7], max_tokens=2),
            echo_seq(1, [9], max_tokens=2, logprobs=True, top_logprobs=1)]
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

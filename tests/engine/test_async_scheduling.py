"""Async scheduling: launch n+1 is scheduled and sent while launch n runs, its rows fed the
ids n left on the device; the coordinator reads ids one launch behind, and a row that a
stop string or EOS already finished samples one extra token that is never streamed."""

from __future__ import annotations

import numpy as np
import pytest

from fusedserve.coordinator.engine.block_manager import BlockManager
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.engine.scheduler import Scheduler
from fusedserve.coordinator.engine.step_outputs import StepOutputs
from fusedserve.coordinator.sampling_params import SamplingParams
from tests.engine.echo_engine import echo_seq
from tests.support import queue, read_step

PROMPTS = ["The history of", "In the beginning", "Python is a", "Once upon a time there",
           "The function returns", "A list of"]


def _params(i: int) -> SamplingParams:
    """Every kind a request may ask: greedy and seeded top-p/top-k/min-p rows, logprobs,
    stop strings, stop ids, max_tokens of different lengths."""
    kinds = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9), dict(temperature=0.7, top_k=20),
             dict(temperature=1.0, min_p=0.05)]
    return SamplingParams(max_tokens=6 + 5 * (i % 4), seed=1000 + i, **kinds[i % 4],
                          logprobs=i % 3 == 0, top_logprobs=2 if i % 3 == 0 else 0,
                          stop=[" the"] if i % 5 == 1 else [], stop_token_ids=[16] if i % 5 == 2 else [])


def _run(async_scheduling: bool, prompts: list[str], **rc: int) -> tuple[list, LLMEngine, int]:
    runner = dict(max_batch=4, block_size=4, num_blocks=rc.pop("num_blocks", 64),
                  async_scheduling=async_scheduling, **rc)
    eng = LLMEngine("default", dtype="float32", **runner)
    try:
        outs = eng.generate(prompts, [_params(i) for i in range(len(prompts))])
    finally:
        eng.close()
    b = eng.core.scheduler.blocks
    assert b.num_used == 0, "every block is free or held by the cache only"
    b.flush()
    assert b.num_free == b.num_blocks
    preempted = sum(o.num_preemptions for o in outs)
    return [(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in outs], eng, preempted


def _same(got: list, want: list) -> None:
    """Tokens, text and finish reasons exactly; logprobs to fp32 noise, since the batches
    around a row differ (fp32 GEMMs are not batch-invariant in their last bits)."""
    assert [g[:3] for g in got] == [w[:3] for w in want]
    for g, w in zip(got, want):
        assert g[3] == pytest.approx(w[3], abs=1e-4)


@pytest.mark.parametrize("rc", [{}, {"max_num_batched_tokens": 12}, {"enable_prefix_caching": False}],
                         ids=["default-budget", "chunked", "no-prefix-cache"])
def test_outputs_identical_with_async_scheduling_on_and_off(rc):
    prompts = PROMPTS * 2  # repeats hit the prefix cache
    want, sync, _ = _run(False, prompts, **dict(rc))
    got, eng, _ = _run(True, prompts, **dict(rc))
    _same(got, want)
    assert sync.core.stats.ahead == 0 and sync.core.stats.fed_rows == 0
    # The coordinator wrote placeholders for the fed rows: equal outputs mean the device fed them.
    assert eng.core.stats.ahead > 0 and eng.core.stats.fed_rows > 0
    assert any(o[2] == "stop" for o in got) and any(o[2] == "length" for o in got)


def test_outputs_identical_under_preemption():
    want, _, _ = _run(False, PROMPTS, num_blocks=10)
    got, eng, preempted = _run(True, PROMPTS, num_blocks=10)
    _same(got, want)
    assert preempted > 0, "the tight cache should force preemption"
    assert eng.core.stats.fed_rows > 0


def test_stop_strings_and_max_tokens_are_exact_and_the_extra_token_is_never_streamed():
    eng = LLMEngine("default", dtype="float32",
                    **dict(max_batch=4, block_size=4, num_blocks=64))
    try:
        free = eng.generate(["The history of"], SamplingParams(max_tokens=12))[0]
        stop_id = free.token_ids[4]
        stop_text = eng.tokenizer.decode(free.token_ids[6:8])
        params = {"eos-like": SamplingParams(max_tokens=12, stop_token_ids=[stop_id]),
                  "stop-string": SamplingParams(max_tokens=12, stop=[stop_text]),
                  "length": SamplingParams(max_tokens=5)}
        sched, rows = eng.core.scheduler, {}
        schedule = sched.schedule

        def recording():  # which requests each launch carried
            batch = schedule()
            for s in batch.seqs if batch else []:
                rows[s.seq_id] = rows.get(s.seq_id, 0) + 1
            return batch

        sched.schedule = recording
        seqs = {k: eng.add_request("The history of", p, k)
                for k, p in params.items()}
        events = {k: [] for k in params}
        while eng.core.has_work():
            for ev in eng.core.step():
                assert not events[ev.seq.seq_id] or not events[ev.seq.seq_id][-1].finished, \
                    "nothing after a request's last event"
                events[ev.seq.seq_id].append(ev)
    finally:
        eng.close()
    eos, stop, length = seqs["eos-like"], seqs["stop-string"], seqs["length"]
    assert eos.output_ids == free.token_ids[:5] and eos.finish_reason == "stop"
    assert stop.finish_reason == "stop" and stop_text not in stop.text
    assert free.text.startswith(stop.text) and len(stop.output_ids) == 8
    assert length.output_ids == free.token_ids[:5] and length.finish_reason == "length"
    for k, seq in seqs.items():
        evs = events[k]
        assert [e.token for e in evs] == seq.output_ids and evs[-1].finished
        assert "".join(e.text for e in evs) == seq.text
    # Stops by a token are seen one launch late: that launch's row was the extra one, dropped.
    # Length is known ahead: no launch beyond the last token.
    assert rows["eos-like"] == 5 + 1 and rows["stop-string"] == 8 + 1
    assert rows["length"] == 5
    assert sched.blocks.num_used == 0


def test_abort_with_two_launches_in_flight_frees_everything(echo_engine):
    """The core's bookkeeping, not the model, is what is tested: model-free (``EchoRunner``)."""
    core = echo_engine(max_batch=4, block_size=4, num_blocks=32).core
    sched = core.scheduler
    a, b = echo_seq(0, [10, 11, 12], max_tokens=20), echo_seq(1, [50, 51], max_tokens=20)
    sched.enqueue(a)
    sched.enqueue(b)
    core.step()  # the prefill is read; the decode launched behind it is in flight
    assert len(core.inflight) == 1 and core.wants_launch() and core.launch()
    assert len(core.inflight) == 2
    n_a = len(a.output_ids)
    sched.abort(a.seq_id)
    events = core.finish(core.executor.wait()) + core.finish(core.executor.wait())
    assert all(ev.seq is b for ev in events) and len(a.output_ids) == n_a
    while core.has_work():
        core.step()
    assert b.finish_reason == "length" and b.output_ids == list(range(52, 72))
    assert sched.blocks.num_used == 0


def test_the_cli_turns_it_off_and_it_is_on_by_default():
    from fusedserve.coordinator.cli_parser import build_parser, server_config

    on = server_config(build_parser().parse_args(["serve"]))
    off = server_config(build_parser().parse_args(["serve", "--no-async-scheduling"]))
    assert on.engine.scheduler.async_scheduling and on.engine.banks == 2
    assert not off.engine.scheduler.async_scheduling and off.engine.banks == 1


def _sched(num_blocks: int = 16) -> Scheduler:
    return Scheduler(BlockManager(num_blocks=num_blocks, block_size=4), max_model_len=64, max_batch=4)


def _ids(*ids: int) -> StepOutputs:
    return StepOutputs(step=1, sampled_ids=np.array(ids, dtype=np.int32))


def test_a_preempted_request_waits_for_its_token_in_flight_and_a_moved_one_is_left_alone():
    s = _sched()
    a = queue(s, "a", [1, 2, 3], SamplingParams(max_tokens=8))
    prefill = s.schedule()
    decode = s.schedule()  # sent behind the prefill: fed the prefill's id on the device
    assert decode.num_decode == 1 and decode.feed_rows.tolist() == [0] and a.num_pending == 2
    s._preempt(a)  # the cache ran out while both were in flight
    assert s.schedule() is None, "not re-admitted while its tokens are still on the device"
    read_step(s, prefill, _ids(7))
    assert a.output_ids == [7] and a.num_pending == 1 and s.schedule() is None
    read_step(s, decode, _ids(9))
    assert a.output_ids == [7, 9] and a.num_pending == 0
    again = s.schedule()  # recomputed from prompt + both tokens
    assert again.num_decode == 0 and again.token_ids.tolist() == [1, 2, 3, 7, 9]

    # Moved to another worker (drained or lost) while its token was in flight: the old
    # worker's late reply must not touch it.
    s.running.remove(a)
    other = _sched()
    other.resume(a)
    assert a.num_pending == 0, "the lost launch's token is drawn again, from the same (seed, step)"
    moved = other.schedule()
    assert moved.num_decode == 0 and a.num_pending == 1
    read_step(s, again, _ids(11))
    assert a.output_ids == [7, 9] and a.num_pending == 1
    read_step(other, moved, _ids(13))
    assert a.output_ids == [7, 9, 13] and a.num_pending == 0

"""Chunked prefill: a per-launch token budget; long prompts are split and share launches
with the running decodes, which keep getting a token every launch."""

from __future__ import annotations

import pytest

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.server.config import ServerConfig
from fusedserve.shared_memory.engine_config import EngineConfig
from tests.engine.echo_engine import echo_seq

LONG = " ".join(f"item {i} is the number {i * 7 % 13}." for i in range(60))
SHORT = ["Hello", "def hello(name):", "The capital of France is"]


def _rc(budget: int, caching: bool = True) -> dict:
    return dict(max_batch=4, block_size=8, num_blocks=128, sampler_candidates=8,
                max_num_batched_tokens=budget, enable_prefix_caching=caching)


@pytest.mark.parametrize("caching", [False, True])
def test_chunked_outputs_equal_unchunked(caching):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    prompts = [*SHORT, LONG, LONG + " And so on."]  # the long ones prefill while the short decode
    with LLMEngine("default", dtype="float32", **_rc(4096, caching)) as eng:  # nothing split
        want = [o.token_ids for o in eng.generate(prompts, params)]
    with LLMEngine("default", dtype="float32", **_rc(24, caching)) as eng:
        eng.runtime.keep_history = 10_000
        got = [o.token_ids for o in eng.generate(prompts, params)]
        launches = eng.runtime.history
        blocks = eng.core.scheduler.blocks
        assert blocks.num_used == 0, "every block is free or only cached"
    assert got == want
    assert all(r.dims.get("T", 1) <= 24 for r in launches), "no launch over the token budget"
    assert any(r.kind == "mixed" for r in launches), "chunks rode with decodes"


def test_a_long_prompt_does_not_stall_a_running_stream(echo_engine):
    """The scheduler's budget, not the model, is what is tested: model-free (``EchoRunner``)."""
    eng = echo_engine(max_batch=4, block_size=8, num_blocks=128, max_model_len=512, max_num_batched_tokens=32)
    core, sched = eng.core, eng.core.scheduler
    stream = echo_seq(0, [5, 6, 7], max_tokens=200, ignore_eos=True)
    sched.enqueue(stream)
    while len(stream.output_ids) < 3:
        core.step()
    long_ids = [(11 * i) % 4000 + 1 for i in range(300)]
    big = echo_seq(1, long_ids, max_tokens=2, ignore_eos=True)
    sched.enqueue(big)
    launches = 0
    before = len(stream.output_ids)
    while not big.output_ids:
        core.step()
        launches += 1
    # Every launch while the prompt prefilled also decoded the stream.
    assert launches >= len(long_ids) // 32
    assert len(stream.output_ids) - before == launches
    assert big.output_ids == [long_ids[-1] + 1]
    assert all(d.dims["T"] <= 32 for d in eng.runner.launches), "no launch over the token budget"
    while sched.has_work():
        core.step()
    assert sched.blocks.num_used == 0


def test_out_of_range_chunking_is_refused_at_start():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig.build(max_batch=8, max_num_batched_tokens=8).check()  # no room beyond the decode rows
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig.build(max_num_batched_tokens=0).check()  # a launch needs a budget
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        ServerConfig.build(max_batch=8, max_num_batched_tokens=3).check()
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        LLMEngine("default", max_batch=8, max_num_batched_tokens=5)
    EngineConfig.build(max_batch=8, max_num_batched_tokens=9).check()

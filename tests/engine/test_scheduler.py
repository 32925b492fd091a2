"""Continuous batching: admission by free blocks, preemption and recompute."""

from __future__ import annotations

from fusedserve.coordinator.engine.block_manager import BlockManager
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.engine.scheduler import Scheduler
from fusedserve.coordinator.sampling_params import SamplingParams
from tests.support import queue

PROMPTS = [f"request {i}: once upon a time" for i in range(6)]


def _params():
    return [SamplingParams(max_tokens=30, ignore_eos=True) if i % 2 else
            SamplingParams(max_tokens=30, temperature=0.9, top_k=10, seed=i, ignore_eos=True)
            for i in range(len(PROMPTS))]


def test_preempted_requests_recompute_to_the_same_output():
    roomy = dict(max_batch=8, block_size=4, num_blocks=200, sampler_candidates=16)
    tight = dict(max_batch=8, block_size=4, num_blocks=40, sampler_candidates=16)  # 6 x 11 blocks needed
    with LLMEngine("default", dtype="float32", **roomy) as eng:
        want = eng.generate(PROMPTS, _params())
    with LLMEngine("default", dtype="float32", **tight) as eng:
        got = eng.generate(PROMPTS, _params())
    assert sum(o.num_preemptions for o in want) == 0
    assert sum(o.num_preemptions for o in got) > 0, "the tight cache should force preemption"
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_newest_request_is_preempted_and_blocks_return():
    blocks = BlockManager(num_blocks=6, block_size=2)
    s = Scheduler(blocks, max_model_len=64, max_batch=4)
    a = queue(s, "a", [1, 2, 3], SamplingParams(max_tokens=8))
    b = queue(s, "b", [4, 5, 6], SamplingParams(max_tokens=8))
    batch = s.schedule()
    assert batch.num_decode == 0 and [q.seq_id for q in batch.seqs] == ["a", "b"]
    assert blocks.num_free == 2
    for seq in (a, b):
        seq.output_ids.extend([7, 7, 7, 7])  # pretend 4 tokens were sampled and read: 7 tokens each
        seq.num_pending = 0
        seq.num_computed = seq.num_tokens - 1  # ... and their K/V computed, as schedule() counts
    batch = s.schedule()  # each needs 4 blocks now: only "a" (the oldest) fits
    assert batch.num_decode == batch.batch_size and [q.seq_id for q in batch.seqs] == ["a"]
    assert [q.seq_id for q in s.waiting] == ["b"] and b.num_preemptions == 1
    s.abort("a")
    assert blocks.num_free == 6
    batch = s.schedule()  # "b" is recomputed from prompt + its tokens so far
    assert batch.num_decode == 0 and batch.token_ids.tolist() == [4, 5, 6, 7, 7, 7, 7]

"""Prefix caching: content-hashed full blocks, shared by reference count, kept after their
sequence ends with LRU eviction; a new prompt prefills only what the cache lacks."""

from __future__ import annotations

import pytest

from fusedserve.coordinator.engine.block_manager import BlockManager, OutOfBlocks
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams

SYSTEM = ("You are a helpful assistant. Answer in one short sentence and never repeat the question. "
          "Cite the documentation where it helps. ") * 3


def test_block_hashes_chain_so_equal_blocks_after_different_prefixes_differ():
    bm = BlockManager(num_blocks=8, block_size=2)
    bm.allocate("a", [1, 2, 3, 4, 5])
    bm.commit("a", [1, 2, 3, 4, 5], 5)
    bm.free("a")
    assert bm.num_cached == 2 and bm.num_free == 8
    assert len(bm.cached_prefix([1, 2, 3, 4, 9, 9])) == 2
    assert len(bm.cached_prefix([1, 2, 3, 4])) == 1, "the last token is always computed"
    assert bm.cached_prefix([7, 7, 3, 4, 5]) == [], "block [3, 4] after another prefix is another block"


def test_shared_blocks_are_counted_and_never_freed_while_held():
    bm = BlockManager(num_blocks=6, block_size=2)
    prompt = [1, 2, 3, 4, 5]
    assert bm.allocate("a", prompt) == 0
    bm.commit("a", prompt, 5)
    assert bm.allocate("b", prompt) == 4  # two blocks reused
    shared = bm.table("a")[:2]
    assert bm.table("b")[:2] == shared and all(bm._refs[x] == 2 for x in shared)
    bm.free("a")
    assert all(bm._refs[x] == 1 for x in shared) and bm.num_used == 3
    with pytest.raises(OutOfBlocks):  # 3 free blocks; the shared ones are not among them
        bm.allocate("c", list(range(50, 58)))
    assert bm.table("b")[:2] == shared
    bm.free("b")
    assert bm.num_used == 0 and bm.num_cached == 2
    assert bm.flush() == 2 and bm.num_cached == 0 and bm.num_free == 6
    assert bm.cached_prefix(prompt) == []


def test_eviction_takes_the_least_recently_used_cached_block():
    bm = BlockManager(num_blocks=4, block_size=2)
    for name, prompt in (("old", [1, 2, 9]), ("new", [3, 4, 9])):
        bm.allocate(name, prompt)
        bm.commit(name, prompt, 3)
        bm.free(name)
    assert bm.num_cached == 2
    bm.allocate("x", [5, 6, 7, 8, 9, 10])  # three blocks: two never-cached ones, then the LRU
    assert bm.stats.evictions == 1
    assert bm.cached_prefix([1, 2, 9]) == [] and len(bm.cached_prefix([3, 4, 9])) == 1


def test_disabled_cache_frees_blocks_and_reuses_nothing():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    bm.allocate("a", [1, 2, 3])
    bm.commit("a", [1, 2, 3], 3)
    bm.free("a")
    assert bm.num_cached == 0 and bm.allocate("b", [1, 2, 3]) == 0 and bm.stats.queries == 0


RC = dict(max_batch=4, block_size=8, num_blocks=64, sampler_candidates=8)


def _prompts(engine) -> list[list[int]]:
    base = engine.input.encode(SYSTEM)
    return [base + engine.input.encode(f" Question {i}: what is {i} plus {i}?") for i in range(6)]


def test_outputs_equal_with_and_without_the_cache_and_prefill_skips_the_prefix():
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLMEngine("default", dtype="float32", **RC) as eng:
        prompts = _prompts(eng)
        first = eng.generate(prompts[:1], params)  # fills the cache
        blocks = eng.core.scheduler.blocks
        assert blocks.stats.hits == 0
        eng.runtime.keep_history = 1000
        cached = eng.generate(prompts, params)  # every prompt reuses the system prompt's blocks
        system = len(eng.input.encode(SYSTEM)) // 8 * 8  # its whole blocks
        assert blocks.stats.hits == len(prompts) and blocks.stats.hit_tokens >= len(prompts) * system
        prefilled = sum(r.dims["T"] - r.num_decode for r in eng.runtime.history)
        assert prefilled == sum(len(p) for p in prompts) - blocks.stats.hit_tokens
        assert prefilled < sum(len(p) for p in prompts) // 3, "prefill ran on the uncached rest only"
        assert blocks.num_used == 0 and blocks.num_cached > 0
        blocks.flush()
        assert blocks.num_free == RC["num_blocks"] and blocks.num_cached == 0
    off = {**RC, "enable_prefix_caching": False}
    with LLMEngine("default", dtype="float32", **off) as eng:
        want = eng.generate(prompts, params)
        assert eng.core.scheduler.blocks.num_cached == 0 and eng.core.scheduler.blocks.stats.queries == 0
    assert first[0].token_ids == want[0].token_ids
    assert [o.token_ids for o in cached] == [o.token_ids for o in want]


def test_preempted_and_rerun_requests_stay_correct_with_the_cache():
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    off = dict(max_batch=4, block_size=8, num_blocks=64, sampler_candidates=8, enable_prefix_caching=False)
    with LLMEngine("default", dtype="float32", **off) as eng:
        prompts = _prompts(eng)[:4]
        want = [o.token_ids for o in eng.generate(prompts, params)]
    # Too few blocks for four full sequences: the newest is preempted and re-run (its own
    # blocks, and the shared system prompt, come back from the cache).
    tight = dict(max_batch=4, block_size=8, num_blocks=40, sampler_candidates=8)
    with LLMEngine("default", dtype="float32", **tight) as eng:
        got = eng.generate(prompts, params)
        blocks = eng.core.scheduler.blocks
        assert sum(o.num_preemptions for o in got) > 0, "the tight cache should force preemption"
        assert blocks.stats.hits > 0 and blocks.num_used == 0
    assert [o.token_ids for o in got] == want

"""Sampling through the engine and the sampler: reproducible, consistent with greedy, the
top-k and top-p sets respected, and settings out of range refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingError, SamplingParams
from fusedserve.kernels.sampler import sample
from fusedserve.shared_memory.sampling_row import SamplingPlan


def draw(values: np.ndarray, ids: np.ndarray, p: SamplingParams, step: int, vocab: int = 1000,
         candidates: int = 64) -> int:
    """One draw of the device sampler over a vocabulary where only ``ids`` are possible."""
    logits = torch.full((1, vocab), float("-inf"))
    logits[0, torch.from_numpy(ids.astype(np.int64))] = torch.from_numpy(values.astype(np.float32))
    f32 = torch.tensor([[p.temperature, p.top_p, p.min_p, p.top_k]], dtype=torch.float32)
    seeds = torch.tensor([[p.seed & 0x7FFF_FFFF_FFFF_FFFF, step]])
    out = torch.empty(1, dtype=torch.int32)
    sample(logits, f32, seeds, out, SamplingPlan.for_rows(f32.numpy(), candidates, vocab), candidates)
    return int(out[0])


@pytest.fixture(scope="module")
def engine():
    rc = dict(max_batch=8, num_blocks=64, sampler_candidates=32)
    with LLMEngine("default", dtype="float32", **rc) as eng:
        yield eng


def test_seeded_sampling_is_reproducible(engine):
    prompts = ["The capital of France is", "Hello there"]

    def params(seed):
        return [SamplingParams(max_tokens=24, temperature=1.0, top_k=20, top_p=0.9, seed=seed,
                               ignore_eos=True) for _ in prompts]

    a = engine.generate(prompts, params(7))
    b = engine.generate(prompts, params(7))
    c = engine.generate(prompts, params(8))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    # Same seed in a different batch composition: same tokens (seeded per request and step).
    alone = engine.generate(prompts[:1], params(7)[:1])
    assert alone[0].token_ids == a[0].token_ids


def test_top_k_1_equals_greedy(engine):
    prompts = ["Once upon a time", "def hello(name):"]
    greedy = engine.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True))
    topk1 = engine.generate(prompts, SamplingParams(max_tokens=20, temperature=0.7, top_k=1, seed=3,
                                                    ignore_eos=True))
    assert [o.token_ids for o in topk1] == [o.token_ids for o in greedy]


def test_asking_for_logprobs_does_not_change_the_draws(engine):
    p_topk = SamplingParams(max_tokens=12, temperature=0.9, top_k=10, seed=5, ignore_eos=True)
    p_full = SamplingParams(max_tokens=12, temperature=0.9, top_k=10, seed=5, ignore_eos=True,
                            logprobs=True)
    a, b = engine.generate(["Numbers: 1 2 3"] * 2, [p_topk, p_full])
    assert a.token_ids == b.token_ids
    assert len(b.logprobs) == 12 and all(lp <= 0.0 for lp in b.logprobs)


def test_sample_respects_top_k_and_top_p():
    values = np.array([5.0, 4.0, 1.0, 0.0, -1.0], dtype=np.float32)
    ids = np.array([10, 11, 12, 13, 14])
    for candidates in (64, 1):  # top_k within the sampler's candidates, and beyond them
        seen = {draw(values, ids, SamplingParams(temperature=1.0, top_k=2, seed=s), 0, candidates=candidates)
                for s in range(200)}
        assert seen == {10, 11}
    # top_p=0.5: the first candidate alone holds > 50% of the mass.
    seen = {draw(values, ids, SamplingParams(temperature=1.0, top_p=0.5, seed=s), 0) for s in range(50)}
    assert seen == {10}


@pytest.mark.parametrize("kwargs", [dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-1.0),
                                         dict(top_k=-1), dict(top_p=0.0), dict(top_p=1.5), dict(seed=-2),
                                    dict(max_tokens="5")])
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(SamplingError) as exc:
        SamplingParams(**kwargs)
    assert list(kwargs)[0] in str(exc.value)

"""Bucketed, padded decode (the shape discipline of captured graphs) equals exact decode."""

from __future__ import annotations

import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.worker.graphs import batch_buckets

PROMPTS = ["The capital of France is", "Hello", "def hello(name):", "Once upon a time there",
           "Numbers: 1 2 3", "Questions and answers:"]


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 24, 32, 40]


def _run(graphs: str):
    rc = dict(max_batch=8, block_size=8, num_blocks=64, sampler_candidates=16, graphs=graphs)
    params = [SamplingParams(max_tokens=10 + 3 * i, ignore_eos=True) if i % 2 == 0 else
              SamplingParams(max_tokens=12, temperature=0.8, top_k=8, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    with LLMEngine("default", dtype="float32", max_model_len=128, **rc) as eng:
        return [o.token_ids for o in eng.generate(PROMPTS, params)]


def test_padded_bucketed_decode_equals_exact_decode():
    # Batches shrink from 6 rows to 1 as requests finish: buckets 8, 4, 2, 1 with padding rows.
    assert _run("padded") == _run("off")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_decode_equals_eager():  # pragma: no cover - runs on GPU machines only
    from fusedserve.coordinator.engine.llm_engine import load_model

    model, tok = load_model("default", "float32", "cuda", 128)
    rc = dict(max_batch=8, block_size=8, num_blocks=64, sampler_candidates=16, graphs="auto")
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LLMEngine(model, **rc, tokenizer=tok) as eng:
        assert set(eng.runner.graphs.graphs) == set(batch_buckets(8))
        graphed = [o.token_ids for o in eng.generate(PROMPTS, params)]
    with LLMEngine(model, **{**rc, "graphs": "off"}, tokenizer=tok) as eng:
        eager = [o.token_ids for o in eng.generate(PROMPTS, params)]
    assert graphed == eager

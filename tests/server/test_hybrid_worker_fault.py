"""A hybrid model's worker SIGKILLed mid-stream: its requests re-run on the other worker, their
recurrent states rebuilt by recompute from the first chunk, and nothing is lost or changed."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from tests.support import running_server, stream_requests, wait_for

RC = dict(max_batch=8, block_size=4, num_blocks=200, sampler_candidates=16)
PROMPTS = [[(i * 7 + j * 3) % 300 + 1 for j in range(9 + 5 * i)] for i in range(6)]
PARAMS = [{"max_tokens": 48, "ignore_eos": True} if i % 2 else
          {"max_tokens": 48, "temperature": 0.8, "top_k": 8, "seed": 11 + i, "ignore_eos": True}
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            max_position_embeddings=512)
    path = tmp_path_factory.mktemp("qwen35_fault")
    Qwen3_5ForCausalLM(cfg).save_pretrained(path)
    with LLMEngine(path, dtype="float32", **RC) as eng:
        want = [eng.generate([p], SamplingParams(**kw))[0].token_ids for p, kw in zip(PROMPTS, PARAMS)]
    return path, want


def test_hybrid_worker_sigkilled_mid_stream_loses_nothing(ray_session, qwen35):
    path, want = qwen35
    with running_server(model=str(path), workers=2, dtype="float32", **RC) as coord:
        streams = stream_requests(coord.address, PROMPTS, PARAMS)
        for _ in PROMPTS:
            assert streams.progressed.acquire(timeout=120), "every stream has 4 tokens before the fault"
        victim = coord.workers[0]
        assert victim.scheduler.running, "the victim is decoding when it is killed"
        os.kill(victim.info["pid"], signal.SIGKILL)
        wait_for(lambda: coord.pool.failures, 60, "the coordinator to notice")
        assert coord.pool.failures[0].requests > 0
        streams.join()
        assert not streams.errors, streams.errors
        for i, w in enumerate(want):
            tokens = [f["token"] for f in streams.frames[i] if f["type"] == "token"]
            assert tokens == streams.frames[i][-1]["token_ids"] == w, f"request {i}"

"""A hybrid model served with ``tensor_parallel_size=2`` (two Ray actors meeting in shared memory,
each with half of every head kind) gives the tokens of one device offline."""

from __future__ import annotations

import torch

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from tests.support import running_server

RC = dict(max_batch=8, block_size=4, num_blocks=128)


def test_served_tp2_equals_one_device(ray_session, tmp_path):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                            max_position_embeddings=512)
    Qwen3_5ForCausalLM(cfg).save_pretrained(tmp_path)
    prompts = [[(i * 7 + j) % 300 + 1 for j in range(5 + 9 * i)] for i in range(4)]
    with LLMEngine(tmp_path, dtype="float32", **RC) as eng:
        want = [o.token_ids for o in eng.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))]
    with running_server(model=str(tmp_path), tensor_parallel_size=2, dtype="float32", **RC) as coord:
        client = Client(coord.address)
        got = [client.generate(p, max_tokens=24, ignore_eos=True)["token_ids"] for p in prompts]
    assert got == want

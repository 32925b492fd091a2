"""The kernels against transformers' Qwen3ForCausalLM on random-weight checkpoints."""

from __future__ import annotations

import pytest
import torch

from coordinator.engine.llm_engine import LLMEngine
from coordinator.sampling_params import SamplingParams
from kernels.model.qwen3 import Qwen3Model
from shared_memory.contract import RunnerConfig

BLOCK = 4


def _hf(path):
    from transformers import Qwen3ForCausalLM

    return Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("name", ["gqa2_untied", "gqa4_tied"])
def test_prefill_and_decode_logits_match(hf_checkpoints, name):
    path = hf_checkpoints[name]
    hf = _hf(path)
    model = Qwen3Model.from_pretrained(path, dtype="float32")
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (21,), generator=g)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = model.new_kv_cache(num_blocks=12, block_size=BLOCK)
    ws = model.new_workspace(max_batch=2, block_size=BLOCK, top_k=8)
    out = model.new_outputs(2, 8)
    table = [7, 2, 9, 0, 11, 4]  # scattered, out of order

    def slot(p):
        return table[p // BLOCK] * BLOCK + p % BLOCK

    n = 9
    model.prefill(ids[:n].int(), torch.arange(n, dtype=torch.int32), [0, n],
                  torch.tensor([slot(p) for p in range(n)]), kv, ws, out)
    torch.testing.assert_close(out.logits[0], ref[n - 1], atol=2e-4, rtol=1e-4)
    bt = torch.tensor([table], dtype=torch.int32)
    for p in range(n, len(ids)):
        model.decode_step(ids[p:p + 1].int(), torch.tensor([p], dtype=torch.int32), bt,
                          torch.tensor([p + 1], dtype=torch.int32), torch.tensor([slot(p)]),
                          kv, ws, out)
        torch.testing.assert_close(out.logits[0], ref[p], atol=2e-4, rtol=1e-4)
        assert out.greedy_ids[0].item() == ref[p].argmax().item()


@pytest.mark.parametrize("name", ["gqa2_untied", "gqa4_tied"])
def test_greedy_32_tokens_identical_to_transformers_generate(hf_checkpoints, name):
    path = hf_checkpoints[name]
    hf = _hf(path)
    prompts = [[5, 17, 42, 99, 3], [250, 1, 8], [77] * 11]
    with torch.no_grad():
        expected = []
        for p in prompts:
            gen = hf.generate(torch.tensor([p]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                              pad_token_id=0)
            expected.append(gen[0, len(p):].tolist())
    with LLMEngine(path, dtype="float32", runner=RunnerConfig(max_batch=4, block_size=BLOCK,
                                                               num_blocks=64, top_k=8)) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=32, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


def test_bf16_logits_close_to_transformers(hf_checkpoints):
    from transformers import Qwen3ForCausalLM

    path = hf_checkpoints["gqa2_untied"]
    hf = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    model = Qwen3Model.from_pretrained(path, dtype="bfloat16")
    ids = torch.arange(3, 15)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    kv = model.new_kv_cache(8, BLOCK)
    ws = model.new_workspace(1, BLOCK, 8)
    out = model.new_outputs(1, 8)
    model.prefill(ids.int(), torch.arange(12, dtype=torch.int32), [0, 12], torch.arange(12), kv, ws, out)
    err = (out.logits[0] - ref[-1]).abs().max().item()
    assert err < 0.1 * ref[-1].abs().max().item(), err

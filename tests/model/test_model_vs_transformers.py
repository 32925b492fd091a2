"""The kernels against transformers' Qwen3ForCausalLM on random-weight checkpoints."""

from __future__ import annotations

import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.worker.model.qwen3 import Qwen3Model
from tests.model_batches import decode_batch, prompt_batch

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
    ws = model.new_workspace(max_rows=2, block_size=BLOCK)
    logits = torch.empty(2, model.config.vocab_size)
    table = [7, 2, 9, 0, 11, 4]  # scattered, out of order

    n = 9
    model.forward(prompt_batch([ids[:n].tolist()], [table], BLOCK), kv, ws, logits[:1])
    torch.testing.assert_close(logits[0], ref[n - 1], atol=2e-4, rtol=1e-4)
    for p in range(n, len(ids)):
        model.forward(decode_batch([(int(ids[p]), p, table)], BLOCK), kv, ws, logits[:1])
        torch.testing.assert_close(logits[0], ref[p], atol=2e-4, rtol=1e-4)
        assert logits[0].argmax().item() == ref[p].argmax().item()


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
    with LLMEngine(path, dtype="float32", **dict(max_batch=4, block_size=BLOCK,
                                                 num_blocks=64, sampler_candidates=8)) as eng:
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
    ws = model.new_workspace(1, BLOCK)
    logits = torch.empty(1, model.config.vocab_size)
    model.forward(prompt_batch([ids.tolist()], [[0, 1, 2]], BLOCK), kv, ws, logits)
    err = (logits[0] - ref[-1]).abs().max().item()
    assert err < 0.1 * ref[-1].abs().max().item(), err


@pytest.mark.parametrize("budget", [2048, 8], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers_log_softmax(hf_checkpoints, budget):
    path = hf_checkpoints["gqa4_tied"]
    hf = _hf(path)
    prompt = [5, 17, 42, 99, 3, 250, 1, 8, 77, 77, 12, 140, 7]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].double(), -1)
    rc = dict(max_batch=4, block_size=BLOCK, num_blocks=64, sampler_candidates=8,
              max_num_batched_tokens=budget)
    with LLMEngine(path, dtype="float32", **rc) as eng:
        eng.generate([prompt], SamplingParams(max_tokens=2))  # its blocks are cached now: not reused
        out = eng.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=3))[0]
    want = [None] + [float(ref[i, prompt[i + 1]]) for i in range(len(prompt) - 1)]
    assert out.prompt_logprobs[0] is None
    assert out.prompt_logprobs[1:] == pytest.approx(want[1:], abs=2e-4)


def test_yarn_rope_logits_match_transformers_past_the_original_window(tmp_path):
    """Qwen3's long-context recipe (rope type yarn, factor 4): the model's context is the original
    window times the factor, and its logits there are transformers'."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    cfg = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                      rope_parameters=rope)
    hf = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.15)
    hf.save_pretrained(tmp_path)
    hf = _hf(tmp_path)
    model = Qwen3Model.from_pretrained(tmp_path, dtype="float32")
    assert model.config.max_context == 256 and model.max_model_len == 256
    ids = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = model.new_kv_cache(num_blocks=64, block_size=BLOCK)
    ws = model.new_workspace(max_rows=200, block_size=BLOCK)
    logits = torch.empty(1, 256)
    model.forward(prompt_batch([ids.tolist()], [list(range(50))], BLOCK), kv, ws, logits)
    torch.testing.assert_close(logits[0], ref[-1], atol=2e-4, rtol=1e-4)

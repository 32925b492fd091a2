"""Qwen3-MoE (``Qwen3MoeForCausalLM``) on small random checkpoints written with transformers:
the loader, routing and experts against transformers' own model, int8, and a served model."""

from __future__ import annotations

import pytest
import torch

from fusedserve.coordinator.client import Client
from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.kernels.model_description.config import Qwen3Config
from fusedserve.worker.model.qwen3 import Qwen3Model
from tests.model_batches import decode_batch, prompt_batch
from tests.serve_proc import ServeProcess

BLOCK = 4
PROMPTS = [[5, 17, 42, 99, 3], [250, 1, 8], [77] * 11, list(range(30, 60))]


def _hf(path):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def test_config_marks_sparse_layers(moe_dir):
    c = Qwen3Config.from_dir(moe_dir)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 32) and c.norm_topk_prob
    assert [c.sparse(i) for i in range(4)] == [True, False, True, True]
    step2 = Qwen3Config.from_dict({**_raw(c), "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert [step2.sparse(i) for i in range(4)] == [False, True, False, True]


def _raw(c: Qwen3Config) -> dict:
    return {"model_type": "qwen3_moe", "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "num_experts": c.num_experts,
            "num_experts_per_tok": c.num_experts_per_tok, "moe_intermediate_size": c.moe_intermediate_size}


def _check_against_transformers(model: Qwen3Model, hf, seed: int, n: int) -> None:
    """A 19-token sequence: its first ``n`` tokens as one prompt, then one decode step per token;
    every step's logits against transformers' over the whole sequence."""
    ids = torch.randint(0, 320, (19,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    kv = model.new_kv_cache(num_blocks=12, block_size=BLOCK)
    ws = model.new_workspace(max_rows=4, block_size=BLOCK)
    logits = torch.empty(1, 320)
    table = [7, 2, 9, 0, 11]
    model.forward(prompt_batch([ids[:n].tolist()], [table], BLOCK), kv, ws, logits)
    torch.testing.assert_close(logits[0], ref[n - 1], atol=2e-4, rtol=1e-4)
    for p in range(n, len(ids)):
        model.forward(decode_batch([(int(ids[p]), p, table)], BLOCK), kv, ws, logits)
        torch.testing.assert_close(logits[0], ref[p], atol=2e-4, rtol=1e-4)


def test_prefill_and_decode_logits_match_transformers(moe_dir):
    model = Qwen3Model.from_pretrained(moe_dir, dtype="float32")
    _check_against_transformers(model, _hf(moe_dir), seed=1, n=9)


def test_greedy_tokens_identical_to_transformers_generate(moe_dir):
    hf = _hf(moe_dir)
    with torch.no_grad():
        want = [hf.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    rc = dict(max_batch=4, block_size=BLOCK, num_blocks=96, sampler_candidates=8)
    with LLMEngine(moe_dir, dtype="float32", **rc) as eng:
        got = eng.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in got] == want  # batched: every row routed on its own


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_experts_stay_close(moe_dir, quantization):
    ref = Qwen3Model.from_pretrained(moe_dir, dtype="float32")
    q = Qwen3Model.from_pretrained(moe_dir, dtype="float32", quantization=quantization)
    ids = torch.randint(0, 320, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    outs = []
    for model in (ref, q):
        kv = model.new_kv_cache(num_blocks=8, block_size=BLOCK)
        ws = model.new_workspace(max_rows=16, block_size=BLOCK)
        logits = torch.empty(1, 320)
        model.forward(prompt_batch([ids], [[0, 1, 2, 3]], BLOCK), kv, ws, logits)
        outs.append(logits[0])
    cos = torch.nn.functional.cosine_similarity(outs[0], outs[1], dim=0).item()
    assert cos > (0.995 if quantization == "int8" else 0.97), cos
    assert isinstance(q.w.layers[0].experts[0][0], type(q.w.layers[1].gate_up))  # experts quantized too


def test_a_moe_model_is_served(ray_session, moe_dir, tmp_path):
    rc = dict(max_batch=8, block_size=16, num_blocks=64)
    with LLMEngine(moe_dir, dtype="float32", **rc) as eng:
        want = eng.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    srv = ServeProcess.start(tmp_path / "serve.log", "--model", str(moe_dir), "--workers", "1", "--dtype",
                             "float32", "--max-batch", "8", "--num-blocks", "64")
    try:
        c = Client(srv.address)
        got = [c.generate(p, max_tokens=12, ignore_eos=True)["token_ids"] for p in PROMPTS]
        c.close()
    finally:
        srv.stop()
    assert got == [o.token_ids for o in want]


def test_grouped_gemm_path_matches_transformers(moe_dir, monkeypatch):
    """The CUDA path (every expert in two ``torch._grouped_mm`` calls, routing sorted on the device)
    forced on here, where ``torch._grouped_mm`` also runs on the CPU."""
    import fusedserve.kernels.backend_table as backend
    monkeypatch.setattr(backend, "_grouped_mm_runs", lambda *a: True)
    model = Qwen3Model.from_pretrained(moe_dir, dtype="float32")
    assert model.kernels.grouped_moe and model.w.layers[0].expert_stack is not None
    hf = _hf(moe_dir)
    _check_against_transformers(model, hf, seed=2, n=12)
    with torch.no_grad():  # batched prompts and decode rows: every row routed on its own
        want = [hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                            pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    rc = dict(max_batch=4, block_size=BLOCK, num_blocks=96, sampler_candidates=8)
    with LLMEngine(moe_dir, dtype="float32", **rc) as eng:
        got = eng.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in got] == want

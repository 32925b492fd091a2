"""The Triton LoRA kernels (``kernels/triton/lora.py``) against a float64 reference per token, on
the CPU under Triton's interpreter (compiled on CUDA with ``FUSEDSERVE_TRITON_COMPILED=1``):
tokens of several adapters and of none mixed, a slot whose adapter leaves the projection alone,
q/k/v parts each expanded from its own columns, ranks that are not a power of two and widths past
the last block; and the same kernels driven by the worker's pool inside a model forward equal
transformers + peft."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.triton_mode import choose

COMPILED = choose()

from fusedserve.kernels.triton.lora import lora_apply  # noqa: E402
from tests.kernels.test_lora_kernel import SHAPES, _reference  # noqa: E402

DEV = torch.device("cuda" if COMPILED else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rank", "k", "widths"), SHAPES)
def test_every_tokens_update_equals_the_reference(dtype, rank, k, widths):
    g = torch.Generator().manual_seed(rank + k)
    parts = [sum(widths[:j]) for j in range(len(widths) + 1)]
    x = torch.randn(11, k, generator=g).to(dtype)
    y = torch.randn(11, parts[-1], generator=g).to(dtype)
    slots = torch.tensor([0, -1, 2, 0, 1, 3, -1, 2, 0, 0, 1], dtype=torch.int32)
    a = (torch.randn(4, len(widths) * rank, k, generator=g) / k ** 0.5).to(dtype)
    bt = torch.randn(4, rank, parts[-1], generator=g).to(dtype)
    active = torch.tensor([1, 1, 1, 0], dtype=torch.uint8)
    want = _reference(x, y, slots, a, bt, parts, active)
    out = y.to(DEV)
    u = torch.empty(16, 3 * rank, dtype=torch.float32, device=DEV)
    lora_apply(x.to(DEV), out, slots.to(DEV), a.to(DEV), bt.to(DEV), parts, active.to(DEV), u)
    got = out.cpu().double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=tol)
    untouched = (slots < 0) | (slots == 3)
    assert torch.equal(got[untouched], want[untouched])


@pytest.mark.skipif(COMPILED, reason="the model half runs on the CPU, under the interpreter")
def test_the_pools_triton_path_in_a_forward_equals_peft(hf_checkpoints, tmp_path):
    """The model on the Triton backend (as on CUDA: its attention, and the pool's Triton LoRA path):
    a launch mixing a base row and one row under each of two adapters equals transformers + peft
    per row."""
    from dataclasses import replace

    from peft import PeftModel
    from transformers import Qwen3ForCausalLM

    from fusedserve.shared_memory.engine_config import LoraConfig
    from fusedserve.worker.lora_pool import LoraPool
    from fusedserve.worker.model.qwen3 import Qwen3Model
    from tests.lora_adapters import ADAPTERS, write_adapter
    from tests.model_batches import prompt_batch

    base = hf_checkpoints["gqa2_untied"]
    dirs = [tmp_path / f"a{i}" for i in range(2)]
    for i, d in enumerate(dirs):
        write_adapter(base, d, i, **ADAPTERS[i])
    hf = Qwen3ForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    peft_model = PeftModel.from_pretrained(hf, dirs[0], adapter_name="a0").eval()
    peft_model.load_adapter(dirs[1], adapter_name="a1")
    prompts, row_slots = [[5, 17, 42, 99, 3], [250, 1, 8, 77], [77] * 6], [-1, 0, 1]
    want = []
    with torch.no_grad():
        for p, s in zip(prompts, row_slots):
            if s < 0:
                with peft_model.disable_adapter():
                    want.append(peft_model(torch.tensor([p])).logits[0, -1])
            else:
                peft_model.set_adapter(f"a{s}")
                want.append(peft_model(torch.tensor([p])).logits[0, -1])
    from fusedserve.kernels.backend_table import triton as triton_backend

    model = Qwen3Model.from_pretrained(base, dtype="float32")
    model.kernels = replace(model.kernels, backend=triton_backend)
    pool = LoraPool(model, LoraConfig(enable_lora=True, max_loras=2), max_tokens=32)
    assert model.lora_apply == pool.apply_triton
    pool.load([[0, "a0#1", str(dirs[0])], [1, "a1#2", str(dirs[1])]])
    kv, ws = model.new_kv_cache(num_blocks=16, block_size=4), model.new_workspace(max_rows=3, block_size=4)
    logits = torch.empty(3, model.config.vocab_size)
    batch = prompt_batch(prompts, [[0, 1], [2, 3], [4, 5]], 4)
    batch.lora_slots = torch.tensor([s for p, s in zip(prompts, row_slots) for _ in p], dtype=torch.int32)
    model.forward(batch, kv, ws, logits)
    for r in range(3):
        torch.testing.assert_close(logits[r], want[r], atol=2e-4, rtol=1e-4, msg=f"row {r}")

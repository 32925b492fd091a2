"""Weight-only int8 and bf16 on the native kernels: accuracy against transformers fp32,
outputs independent of the batch (in-process and served), and the plumbing that selects them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fusedserve.coordinator.engine.llm_engine import LLMEngine
from fusedserve.coordinator.model_files.default_model import TRAINED_DIR
from fusedserve.coordinator.model_files.tokenizer import TextTokenizer
from fusedserve.coordinator.sampling_params import SamplingParams
from fusedserve.coordinator.server.config import ServerConfig
from fusedserve.kernels.linear import Int8Weight, PackedWeight
from fusedserve.kernels.native import build as native
from fusedserve.worker.model.qwen3 import Qwen3Model, resolve_dtype
from tests.model_batches import decode_batch, prompt_batch

needs_native = pytest.mark.skipif(native.kernels() is None, reason="native kernels unavailable here")


def _last_logits(model: Qwen3Model, prompts: list[list[int]]) -> torch.Tensor:
    """Each prompt's next-token logits from one packed prefill."""
    bs = 16
    kv = model.new_kv_cache(sum(-(-len(p) // bs) for p in prompts) + 1, bs)
    ws, logits = model.new_workspace(len(prompts), bs), torch.empty(len(prompts), model.config.vocab_size)
    tables, block = [], 0
    for p in prompts:
        tables.append(list(range(block, block + -(-len(p) // bs))))
        block += len(tables[-1])
    model.forward(prompt_batch(prompts, tables, bs), kv, ws, logits)
    return logits


def heldout_positions() -> tuple[list[int], list[int]]:
    """400 tokens of the trained model's held-out text and the 50 prefix ends scored on them."""
    ids = TextTokenizer.from_dir(TRAINED_DIR).encode((TRAINED_DIR / "heldout.txt").read_text()[:4000])[:400]
    return ids, list(range(8, len(ids) + 1, 8))


def hf_logits(model_dir, ids: list[int], ends: list[int]) -> torch.Tensor:
    """transformers fp32: the next-token logits after each of ``ends`` prefixes of ``ids``."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0][[e - 1 for e in ends]]


def agreement(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, max |logit error|)."""
    return (got.argmax(-1) == ref.argmax(-1)).float().mean().item(), (got - ref).abs().max().item()


def test_quantized_next_token_logits_agree_with_transformers_fp32():
    """Through fusedserve's kernels on the trained model, 50 positions: int8 and int4 with int8
    activations, and int8 weight-only, against transformers in fp32. int4's logit error bound is
    looser (a 4-bit step is 16x an 8-bit one; measured 0.76 here)."""
    from transformers import Qwen3ForCausalLM

    text = (TRAINED_DIR / "heldout.txt").read_text()[:4000]
    ids = TextTokenizer.from_dir(TRAINED_DIR).encode(text)[:400]
    hf = Qwen3ForCausalLM.from_pretrained(TRAINED_DIR, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    ends = list(range(8, len(ids) + 1, 8))
    ref = want[[e - 1 for e in ends]]
    report = {}
    for name in ("none", "int8-weight-only", "int8", "int4"):
        model = Qwen3Model.from_pretrained(TRAINED_DIR, dtype="bfloat16", quantization=name)
        got = _last_logits(model, [ids[:e] for e in ends])
        report[name] = ((got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
                        (got - ref).abs().max().item())
    print("vs transformers fp32 (top-1 agreement, max |logit error|):", report)
    bf16 = report["none"][1]
    for name, bound in (("int8-weight-only", 0.5), ("int8", 0.5), ("int4", 1.0)):
        agree, err = report[name]
        assert agree >= 0.95 and err < bound, (name, report)
    assert report["int8-weight-only"][1] < 2.5 * bf16 + 0.1, "int8 weights alone err of the order of bf16"
    assert report["int8"][1] < 4 * bf16 + 0.1, "int8 activations add an error of the same order"


def test_int8_model_stores_int8_projections_and_says_so(hf_checkpoints):
    m16 = Qwen3Model.from_pretrained(hf_checkpoints["gqa4_tied"], dtype="bfloat16")
    m8 = Qwen3Model.from_pretrained(hf_checkpoints["gqa4_tied"], dtype="bfloat16", quantization="int8")
    lw = m8.w.layers[0]
    for name in ("qkv", "o_proj", "gate_up", "down"):
        w = getattr(lw, name)  # int8, packed or not for its kernel
        assert isinstance(w, (Int8Weight, PackedWeight)) and tuple(w.shape) == tuple(getattr(
            m16.w.layers[0], name).shape)
        assert (w.q if isinstance(w, Int8Weight) else w.packed).dtype == torch.int8
    assert isinstance(m8.w.lm_head, (Int8Weight, PackedWeight)) and m8.w.embed.dtype == torch.bfloat16
    info = m8.kernel_info()
    assert info["quantization"] == "int8" and info["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="quantization"):
        Qwen3Model.from_pretrained(hf_checkpoints["gqa4_tied"], quantization="int3")


def test_auto_dtype_follows_the_documented_rule(monkeypatch):
    cpu = "cpu"  # the device's type
    assert resolve_dtype(None, torch.float32, cpu) == torch.float32  # None: the checkpoint's
    assert resolve_dtype("float16", torch.bfloat16, cpu) == torch.float16
    assert resolve_dtype("auto", torch.bfloat16, "meta") == torch.bfloat16
    assert resolve_dtype("auto", torch.float32, "meta") == torch.bfloat16
    monkeypatch.setattr(native, "expected", lambda: False)
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert resolve_dtype("auto", torch.bfloat16, cpu) == torch.float32
    monkeypatch.setattr(native, "cpu_flags", lambda: {"avx512f", "avx512_bf16"})
    assert resolve_dtype("auto", torch.bfloat16, cpu) == torch.bfloat16
    monkeypatch.setattr(native, "expected", lambda: True)
    assert resolve_dtype("auto", torch.float16, cpu) == torch.float16


def _decode_all(model, prompts, steps, bs=4):
    """Greedy prefill each prompt alone, then decode all of them together; per-row logits."""
    kv = model.new_kv_cache(64, bs)
    ws, logits = model.new_workspace(len(prompts), bs), torch.empty(len(prompts), model.config.vocab_size)
    tables = [list(range(16 * i, 16 * i + 16)) for i in range(len(prompts))]
    state = []
    for p, t in zip(prompts, tables):
        model.forward(prompt_batch([p], [t], bs), kv, ws, logits)
        state.append([int(logits[0].argmax()), len(p)])
    rows = []
    for _ in range(steps):
        model.forward(decode_batch([(s[0], s[1], t) for s, t in zip(state, tables)], bs), kv, ws, logits)
        rows.append(logits[: len(prompts)].clone())
        for r, s in enumerate(state):
            s[0], s[1] = int(logits[r].argmax()), s[1] + 1
    return torch.stack(rows, 1)


@needs_native
@pytest.mark.parametrize("quantization", [None, "int8", "int8-weight-only", "int4"])
def test_bf16_decode_rows_are_bit_identical_alone_and_batched(hf_checkpoints, quantization):
    model = Qwen3Model.from_pretrained(hf_checkpoints["gqa2_untied"], dtype="bfloat16",
                                       quantization=quantization)
    prompts = [[1, 2, 3], list(range(10, 27)), [200], [5] * 9]
    batched = _decode_all(model, prompts, 5)
    for i, p in enumerate(prompts):
        assert torch.equal(batched[i], _decode_all(model, [p], 5)[0]), f"row {i}"


RC = dict(max_batch=8, block_size=8, num_blocks=96, sampler_candidates=16)
PROMPTS = [f"prompt {i}: the capital of France is" for i in range(5)] + ["Hello", "def hello(name):"]


@needs_native
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_served_bf16_equals_offline_alone(ray_session, quantization):
    """Served with strangers in bf16 (int8, int4), each request equals the offline run of it alone."""
    from fusedserve.coordinator.client import (
        Client,  # the served path's imports (zmq, Ray): not a GPU image's
    )
    from tests.support import running_server

    params = {"max_tokens": 10, "ignore_eos": True}
    with LLMEngine("default", dtype="bfloat16", quantization=quantization, **RC) as eng:
        want = [eng.generate([p], SamplingParams(**params))[0].token_ids for p in PROMPTS]
    with running_server(**RC, dtype="bfloat16", quantization=quantization) as coord:
        def one(i: int) -> list[int]:
            with Client(coord.address) as c:
                return c.generate(PROMPTS[i], **params)["token_ids"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(one, range(len(PROMPTS))))
        assert got == want
        kernels = Client(coord.address).stats()["workers"][0]["kernels"]
        assert kernels["quantization"] == (quantization or "none")
        assert kernels["linear"].startswith("native-") and kernels["attention"].startswith("native-")


def test_server_refuses_an_unknown_quantization():
    with pytest.raises(ValueError, match="quantization must be"):
        ServerConfig.build(quantization="int3").check()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_aten_int8_paths_match_the_dequantized_weight(device):
    """The int8 matmul without the native kernels (CPU fallback, CUDA): ATen's int8pack op,
    and the per-call dequantization where a build lacks it."""
    from fusedserve.kernels.linear import LinearOp

    dev = torch.device(device)
    op = LinearOp(dev, None, torch.bfloat16)
    assert op.int8_op in ("int8pack", "dequantize")
    w = Int8Weight.quantize(torch.randn(24, 64) * 0.1, torch.bfloat16, dev)
    x = torch.randn(3, 64).bfloat16().to(dev)
    ref = x.double() @ (w.q.double() * w.scale.double()[:, None]).t()
    for kind in (op.int8_op, "dequantize"):
        op.int8_op = kind
        out = torch.empty(3, 24, dtype=torch.bfloat16, device=dev)
        op(x, w, out)
        assert (out.double() - ref).abs().max().item() < 2 ** -7 * ref.abs().max().item() + 1e-2, kind
